"""What makes the SLO search cheap without changing its answers: warm-started brackets for later seeds (the pool
that starts those searches as soon as their hint is known: tests/test_sim_serve_search_pool.py)."""
from __future__ import annotations

import pytest

from kvlab.experiments.sim.serve import slo

TARGET = slo.parse_slo("p99_ttft_ms<=2000,p99_tpot_ms<=50")


def planted(knee: float):
    def service(rate):
        ttft = 100.0 if rate <= knee else 100.0 + 1e6 * (rate - knee)
        return {"failed": 0, "p99_ttft_ms": ttft, "p99_tpot_ms": 20.0}
    return service


@pytest.mark.parametrize("hint", [0.9, 0.97, 1.0, 1.03, 1.2, 3.0, 0.01])
def test_a_warm_start_finds_the_knee_from_near_and_far(hint):
    knee = 23.7
    found = slo.search(planted(knee), TARGET, start=knee * hint, rel_tol=0.02, step=1.05)
    lo_passed = [r for r, ok in found.evaluations if ok]
    hi_missed = [r for r, ok in found.evaluations if not ok]
    assert found.rate <= knee and min(hi_missed) / found.rate - 1 <= 0.02 * (1 + 1e-9) and found.rate == max(lo_passed)


def test_a_warm_start_near_the_answer_takes_fewer_runs_than_doubling():
    knee = 23.7
    cold = slo.search(planted(knee), TARGET, start=4.0, rel_tol=0.02)
    warm = slo.search(planted(knee), TARGET, start=knee * 1.02, rel_tol=0.02, step=1.05)
    assert len(warm.evaluations) <= 4 < len(cold.evaluations)
    assert warm.rate == pytest.approx(cold.rate, rel=0.021)


@pytest.mark.parametrize("hint", [0.985, 1.0, 1.015])
def test_a_warm_start_within_one_tolerance_of_the_answer_takes_two_runs(hint):
    knee = 23.7
    found = slo.search(planted(knee), TARGET, start=knee * hint, rel_tol=0.02, step=slo.warm_step(0.02))
    assert len(found.evaluations) == 2 and [ok for _, ok in found.evaluations].count(True) == 1
    hi = max(r for r, _ in found.evaluations)
    assert found.rate <= knee < hi and hi / found.rate - 1 == pytest.approx(0.02)


def test_a_bracket_exactly_one_tolerance_wide_is_not_bisected_for_rounding():
    # 16.6 * 1.02 / 16.6 - 1 is 0.020000000000000018 in floating point: without slack it would take a third run
    found = slo.search(planted(16.8), TARGET, start=16.6, rel_tol=0.02, step=1.02)
    assert [ok for _, ok in found.evaluations] == [True, False]


def test_the_rate_search_starts_above_the_knee_by_default():
    """A run past the knee stops early and one below it runs to its end, so the default start is high; the
    concurrency axis keeps its own."""
    from kvlab.experiments.cli import flags
    from kvlab.experiments.sim.serve import cli

    def jobs(*extra):
        parser = flags.KvlabParser(prog="kvlab")
        cli.add_parser(parser.add_subparsers(dest="command").add_parser("simulate").add_subparsers(dest="sim"))
        s = cli.settings_from(parser.parse_args(["simulate", "serve", "--backends", "paged-16", "--slo",
                                                 "p99_ttft_ms<=2000", "--no-save", *extra]))
        return [job[4] for job in cli.slo_jobs(s, s.cases())[1]]
    assert jobs() == [cli.RATE_START]
    assert jobs("--slo-start", "3") == [3.0]
    assert jobs("--search", "max-concurrency") == [cli.CONCURRENCY_START]


def test_the_default_bracket_is_bisected_to_the_tolerance_in_one_try_fewer_than_doubling():
    """bracket_step(0.02) = 1.02^32: five bisections end at exactly 2%, where a doubled bracket needs six."""
    def bisections(found):      # the tries after the first miss above a pass
        first_miss = next(i for i, (_, ok) in enumerate(found.evaluations) if not ok)
        return len(found.evaluations) - first_miss - 1
    default = slo.search(planted(23.7), TARGET, start=4.0, rel_tol=0.02)
    doubling = slo.search(planted(23.7), TARGET, start=4.0, rel_tol=0.02, step=2.0)
    assert [r for r, _ in doubling.evaluations][:4] == [4.0, 8.0, 16.0, 32.0]
    assert slo.bracket_step(0.02) == pytest.approx(1.02 ** 32)
    assert default.evaluations[1][0] == pytest.approx(4 * 1.02 ** 32)
    assert bisections(default) == 5 and bisections(doubling) == 6
    assert default.rate == pytest.approx(doubling.rate, rel=0.021) and default.rate <= 23.7


@pytest.mark.slow     # ~14 s: three seeds of a real search, twice; the tests above check the warm start's parts
def test_cli_warm_started_seeds_are_verified_answers_in_fewer_runs(tmp_path):
    """Seed 0 searches exactly as before; later seeds' answers passed at their rate and missed within the
    tolerance above it, on their own seed; and the whole search took fewer runs than independent seeds."""
    import json

    from kvlab.experiments.cli.main import main
    common = ["simulate", "serve", "--backends", "reserve,paged-16", "--num-prompts", "60", "--budget-gb", "6",
              "--jobs", "2", "--no-progress", "--seeds", "3", "--slo", "p99_ttft_ms<=300,p99_tpot_ms<=30",
              "--slo-tolerance", "0.05", "--no-plots"]
    found = {}
    for mode in ("warm", "independent"):
        extra = ["--independent-seeds"] if mode == "independent" else []
        assert main([*common, *extra, "--out", str(tmp_path / mode)]) == 0
        found[mode] = json.loads((tmp_path / mode / "sim_serve.json").read_text())["result"]["searches"]
        assert [(s["backend"], s["seed"]) for s in found[mode]] == [
            (b, s) for b in ("reserve", "paged-16") for s in (0, 1, 2)]
    for warm, independent in zip(found["warm"], found["independent"]):
        if warm["seed"] == 0:
            assert warm == independent
        rate, evaluations = warm["slo_rate"], [tuple(e) for e in warm["evaluations"]]
        assert (rate, True) in evaluations
        assert min(r for r, ok in evaluations if not ok and r > rate) <= rate * 1.05
    assert (sum(len(s["evaluations"]) for s in found["warm"])
            < sum(len(s["evaluations"]) for s in found["independent"]))
