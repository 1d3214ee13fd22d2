"""Early stop of SLO-search runs: the percentile rule matches numpy, the watch stops exactly when the SLO is lost,
and a search with early stop finds the same rate as one that runs every point to the end."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvlab.experiments.sim.core import HOST_TIMED
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.early_stop import SloMissed, SloWatch, late_needed, targets
from kvlab.experiments.sim.serve.run import ServeSpec, parse_backends, run_point


@pytest.mark.parametrize("n", [1, 2, 7, 100, 101, 2000])
@pytest.mark.parametrize("q", [50.0, 90.0, 99.0, 99.9])
def test_late_needed_values_above_a_limit_always_lift_numpys_percentile(n, q):
    """Sound: any `needed` values above the limit, whatever the rest, put the percentile above it. Tight for
    the order statistic the rule reads: one fewer, and that order statistic can sit at or below the limit."""
    rng = np.random.default_rng(n)
    needed = late_needed(n, q)
    for _ in range(20):
        values = np.concatenate([rng.uniform(0, 1, n - needed), 1 + rng.uniform(1e-9, 5, needed)])
        assert np.percentile(values, q) > 1.0
    k = math.floor(q / 100 * (n - 1))
    fewer = np.sort(np.concatenate([np.zeros(n - needed + 1), np.full(needed - 1, 2.0)]))
    assert fewer[k] <= 1.0


def test_targets_take_percentile_ttft_and_tpot_keys_only():
    got = targets({"p99_ttft_ms": 2000, "median_tpot_ms": 50, "mean_ttft_ms": 10, "p99_e2el_ms": 9})
    assert got == {"p99_ttft_ms": (99.0, "ttft", 2.0), "median_tpot_ms": (50.0, "tpot", 0.05)}


def test_ttft_watch_stops_when_the_late_requests_reach_the_percentile_index():
    n, limit = 100, 1.0
    watch = SloWatch({"p90_ttft_ms": limit * 1000}, [0.0] * n, [1] * n)
    needed = late_needed(n, 90.0)
    for i in range(n - needed):                      # these answer in time
        watch.on_token(str(i), 1, 0.0, 1, 0.5)
    watch.check(0.5)
    watch.check(1.0)                                 # the deadline itself is not late yet
    with pytest.raises(SloMissed) as e:
        watch.check(1.01)                            # the others have no token past arrival + limit
    assert e.value.key == "p90_ttft_ms"


def test_ttft_watch_does_not_stop_one_request_short():
    n = 100
    watch = SloWatch({"p90_ttft_ms": 1000}, [0.0] * n, [1] * n)
    for i in range(n - late_needed(n, 90.0) + 1):
        watch.on_token(str(i), 1, 0.0, 1, 0.9)
    watch.check(50.0)                                # one too few late: no stop


def test_tpot_watch_uses_the_lower_bound_of_unfinished_requests():
    n = 10
    watch = SloWatch({"p50_tpot_ms": 100}, [0.0] * n, [11] * n)
    for i in range(n):
        watch.on_token(str(i), 1, 0.0, 11, 0.0)       # first tokens at t=0, ten more to come
    for step in range(31):
        watch.check(0.5)                              # (0.5 - 0) / 10 = 50 ms: still possible
    with pytest.raises(SloMissed):
        for step in range(32):
            watch.check(1.2)                          # >= 120 ms per token for every request: lost


@pytest.mark.parametrize("backend", ["reserve", "vmm-2MiB"])
def test_search_with_early_stop_finds_the_same_rate_in_fewer_simulated_steps(backend):
    case = parse_backends([backend], 60.0, 0.05)[0]
    spec = ServeSpec(num_requests=150, model_prefill=True)
    target = {"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}
    full = slo.search(lambda r: run_point(case, spec, r, 3), target, 8.0, 0.05)
    early = slo.search(lambda r: run_point(case, spec, r, 3, stop_on_miss=target), target, 8.0, 0.05)
    assert early.rate == full.rate > 0
    assert [p for _, p in early.evaluations] == [p for _, p in full.evaluations]
    stopped = [r for r in early.results.values() if r.get("stopped_early")]
    assert stopped and all(not slo.meets(r, target) for r in stopped)
    for rate, r in early.results.items():
        if r.get("stopped_early"):                    # a stopped run really missed, and stopped before the end
            assert not slo.meets(full.results[rate], target)
            assert r["stopped_at_s"] < full.results[rate]["duration"]
        else:                                         # a run that was not stopped is the same run
            assert figures(r) == figures(full.results[rate])


def figures(result: dict) -> str:
    """The result without host timings, as text (so NaN equals NaN)."""
    sim = {k: v for k, v in result["sim"].items() if k not in HOST_TIMED}
    return json.dumps({**result, "sim": sim}, sort_keys=True, default=str)
