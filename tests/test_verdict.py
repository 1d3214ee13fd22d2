"""One function words every verdict: significantly higher / lower / not distinguishable, from intervals."""
from kvlab.experiments.reporting.verdict import (
    HIGHER,
    LOWER,
    SAME,
    Interval,
    judge,
    judge_ratio,
    sentence,
    short_run_warning,
    spread,
)


def test_disjoint_intervals_are_significant_and_overlapping_ones_are_not():
    assert judge(spread([10, 11, 12]), spread([20, 21, 22])) == HIGHER
    assert judge(spread([20, 21, 22]), spread([10, 11, 12])) == LOWER
    assert judge(spread([10, 12, 14]), spread([13, 15, 17])) == SAME


def test_a_change_within_the_noise_is_not_called_real_even_when_disjoint():
    a, b = Interval(100, 101, 102), Interval(110, 111, 112)       # +9.9%
    assert judge(a, b, noise=0.05) == HIGHER and judge(a, b, noise=0.65) == SAME


def test_ratio_intervals_excluding_one_are_significant():
    assert judge_ratio(0.823, 0.947) == LOWER            # the study's vmm-256KiB: not "within the intervals"
    assert judge_ratio(1.02, 1.2) == HIGHER and judge_ratio(0.95, 1.01) == SAME


def test_sentences_and_the_short_run_warning():
    assert sentence("vmm", "paged", LOWER, "SLO rate") == "vmm is significantly lower than paged in SLO rate"
    assert sentence("vmm", "paged", SAME) == "vmm and paged are not distinguishable"
    assert short_run_warning(2000, 1000) is None
    assert "100 requests is a short run" in short_run_warning(100, 1000)


def test_an_overloaded_server_is_said_to_be():
    from kvlab.experiments.loadgen.sweep import overload_line
    assert "overloaded: 0.8 req/s achieved of 4 offered" in overload_line(4.0, 0.8)
    assert overload_line(4.0, 3.9) is None and overload_line(float("inf"), 0.1) is None
