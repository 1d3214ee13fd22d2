"""Timed figures come with their spread, and a difference is claimed only when the runs do not overlap."""
from kvlab.experiments.reporting.tables import median, verdict, with_spread


def test_with_spread_gives_median_and_range():
    assert with_spread([1200.0, 1500.0, 1100.0]) == "1,200 [1,100-1,500]"
    assert with_spread([5.0]) == "5.0"
    assert with_spread([None]) == "-"
    assert median([1, 3, 2, 4]) == 2.5


def test_overlapping_runs_are_not_distinguishable():
    text = verdict("vmm", [1160.0, 1300.0, 1506.0], "paged", [1029.0, 1200.0, 1336.0])
    assert text.startswith("vmm and paged are not distinguishable in tok/s") and "1,160-1,506" in text


def test_disjoint_runs_name_the_faster_backend():
    text = verdict("vmm", [1400.0, 1500.0, 1450.0], "paged", [1000.0, 1100.0, 1050.0])
    assert text.startswith("vmm is significantly higher than paged in tok/s in every run") and "x1.38" in text
    text = verdict("paged", [1000.0, 1100.0, 1050.0], "vmm", [1400.0, 1500.0, 1450.0])
    assert text.startswith("paged is significantly lower than vmm in tok/s in every run") and "x0.72" in text


def test_too_few_runs_claims_nothing():
    text = verdict("vmm", [1400.0, 1500.0], "paged", [1000.0, 1100.0])
    assert "too few runs" in text and "significantly" not in text


def test_perf_goal_within_noise_is_not_met():
    from kvlab.experiments.bench.perf.harness import Goal, Result
    from kvlab.experiments.bench.perf.report import table
    from kvlab.experiments.bench.perf.report import verdict as perf_verdict
    goal = Goal(">=", 1.5)
    straddles = Result("attention", "ratio", 1.55, "x", goal, detail={"per_repeat": [1.43, 1.55, 1.62]})
    clears = Result("attention", "ratio", 1.8, "x", goal, detail={"per_repeat": [1.7, 1.8, 1.9]})
    misses = Result("attention", "ratio", 1.2, "x", goal, detail={"per_repeat": [1.1, 1.2, 1.3]})
    assert perf_verdict(straddles) == "within noise 2/3"
    assert perf_verdict(clears) == "met 3/3"
    assert perf_verdict(misses) == "MISSED 0/3"
    assert perf_verdict(Result("a", "b", 2.0, "x", goal)) == "met (median only)"
    assert "1.43-1.62" in table([straddles])
