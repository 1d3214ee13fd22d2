"""`kvlab bench serve --base-urls`: the phase arithmetic, the share timeline, and the multi-model mode against
real tiny servers on a shared pool."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvlab.common.errors import ConfigError
from kvlab.experiments.cli import main as cli
from kvlab.experiments.loadgen.phases import Phases, burst_of
from kvlab.experiments.loadgen.shares import engine_share, on_grid, share_timeline
from kvlab.experiments.loadgen.sweep import kvlab_server


def test_each_model_bursts_in_its_own_phase_of_every_period():
    p = Phases(models=3, period_s=9.0, duty=0.5, burst_rate=10.0, periods=2)
    assert p.phase_s == 3.0 and p.duration_s == 18.0
    assert p.bursts(0) == [(0.0, 1.5), (9.0, 10.5)]
    assert p.bursts(2) == [(6.0, 7.5), (15.0, 16.5)]
    assert [burst_of(p, t) for t in (0.0, 1.4, 1.6, 3.0, 4.49, 4.5, 6.1, 8.9, 9.2, 16.0)] == \
        [0, 0, None, 1, 1, None, 2, None, 0, 2]


def test_windows_tile_the_run_and_carry_the_rates():
    p = Phases(models=2, period_s=4.0, duty=0.5, burst_rate=8.0, idle_rate=1.0, periods=2)
    w = p.windows(1)
    assert w == [(0.0, 2.0, 1.0), (2.0, 3.0, 8.0), (3.0, 6.0, 1.0), (6.0, 7.0, 8.0), (7.0, 8.0, 1.0)]
    assert all(a[1] == b[0] for a, b in zip(w, w[1:])) and w[0][0] == 0 and w[-1][1] == p.duration_s
    full = Phases(models=3, period_s=3.0, duty=1.0, burst_rate=5.0)
    assert full.windows(0) == [(0.0, 1.0, 5.0), (1.0, 3.0, 0.0)]          # duty 1: bursts tile the period
    assert full.windows(2) == [(0.0, 2.0, 0.0), (2.0, 3.0, 5.0)]


def test_arrivals_fall_in_the_bursts_at_the_burst_rate_and_repeat_with_the_seed():
    p = Phases(models=3, period_s=30.0, duty=0.8, burst_rate=50.0, periods=4)
    for model in range(3):
        times = p.arrivals(model, seed=7)
        assert times == sorted(times) and times == p.arrivals(model, seed=7)
        assert all(burst_of(p, t) == model for t in times)
        expected = 50.0 * 0.8 * 10.0 * 4                                     # rate x burst length x periods
        assert abs(len(times) - expected) < 4 * np.sqrt(expected)
    assert p.arrivals(0, seed=7) != p.arrivals(1, seed=7) != p.arrivals(1, seed=8)


def test_idle_rate_sends_between_bursts():
    p = Phases(models=2, period_s=100.0, duty=0.5, burst_rate=20.0, idle_rate=2.0)
    times = np.asarray(p.arrivals(0))
    between = times[times >= 25.0]
    assert abs(len(between) - 150) < 50 and len(times) - len(between) > 400


def test_shares_from_the_pool_block_or_the_usage_ratio_on_one_grid():
    pooled = {"t": [0.1, 0.5], "pool_total_bytes": [100, 100], "pool_engine_bytes": [10, 60],
              "kv_usage_ratio": [0.9, 0.9]}
    static = {"t": [0.3], "pool_total_bytes": [None], "pool_engine_bytes": [None], "kv_usage_ratio": [0.5]}
    assert engine_share(pooled, 2)[1].tolist() == [0.1, 0.6]
    assert engine_share(static, 2)[1].tolist() == [0.25]          # its own half of the memory, half used
    grid = np.array([0.0, 0.2, 0.4, 0.6])
    assert on_grid(np.array([0.1, 0.5]), np.array([0.1, 0.6]), grid).tolist() == [0.0, 0.1, 0.1, 0.6]
    timeline = share_timeline([pooled, static], duration_s=0.4)
    assert timeline["t_s"] == [0.0, 0.2, 0.4]
    assert timeline["share"] == [[0.0, 0.1, 0.1], [0.0, 0.0, 0.25]]


@pytest.mark.parametrize("argv, message", [
    (["--burst-rate", "0"], "--burst-rate must be a finite number > 0"),
    (["--idle-rate", "9"], "--idle-rate must be a finite number in [0, 4]"),
    (["--duty-cycle", "1.5"], "--duty-cycle must be a finite number > 0 and <= 1"),
    (["--periods", "0"], "--periods must be an integer in [1, 10,000]"),
    (["--period", "1e9"], "--period must be a finite number > 0"),
    (["--backends", "vmm"], "--base-urls drives running servers"),
    (["--burst-rate", "0.001", "--period", "1"], "model 0 gets no request"),
])
def test_bad_phase_flags_are_one_line(capsys, argv, message):
    rc = cli.main(["bench", "serve", "--base-urls", "http://127.0.0.1:9,http://127.0.0.1:10", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and message in err, err


def test_base_urls_are_checked(capsys):
    for urls, message in (("http://a:1,http://a:1", "names a server twice"), ("ftp://x", "give an http://")):
        rc = cli.main(["bench", "serve", "--base-urls", urls])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and message in err and err.count("\n") == 0


@pytest.mark.slow     # ~18 s: two real servers on a pool; the tests above run the same client against fakes
def test_multi_model_run_against_two_pooled_tiny_servers(tmp_path, capsys):
    """Two vmm servers on one pool, one burst each: every request completes, model 1's requests all arrive in its
    phase, the result file has a block per model, the configuration and provenance, and the pool's bytes."""
    pool = f"kvlab-test-multi-{os.getpid()}"
    flags = ["--kv-cache-bytes", "4MiB", "--kv-pool", pool, "--kv-pool-bytes", "4MiB", "--max-model-len", "256"]
    with kvlab_server("vmm", "tiny", flags) as a, kvlab_server("vmm", "tiny", flags) as b:
        rc = cli.main(["bench", "serve", "--base-urls", f"{a},{b}", "--burst-rate", "6", "--period", "2",
                       "--periods", "1", "--random-input-len", "48", "--random-output-len", "8",
                       "--goodput", "ttft:60000", "--save-result", "--result-dir", str(tmp_path),
                       "--result-filename", "multi.json", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("within the SLOs") == 2
    doc = json.loads((tmp_path / "multi.json").read_text())
    models = doc["models"]
    assert [m["base_url"] for m in models] == [a, b] and all(m["failed"] == 0 for m in models)
    assert all(m["slo_attainment"] == 1.0 and m["p99_ttft_ms"] > 0 for m in models)
    assert models[1]["bursts"] == [[1.0, 2.0]]
    assert all(1.0 <= q["start_s"] < 2.2 for q in models[1]["requests"])   # sent in its phase (+ client lag)
    assert doc["config"]["phases"]["burst_rate"] == 6.0 and doc["provenance"]["kvlab"]["commit"] is not None
    pooled = [s for s in doc["samples"] if any(s["pool_engine_bytes"])]
    assert len(pooled) == 2 and all(s["pool_total_bytes"][-1] == 4 * 2**20 for s in pooled)
    assert len(doc["share_timeline"]["share"]) == 2 and max(map(max, doc["share_timeline"]["share"])) > 0
    assert (tmp_path / "multi.png").stat().st_size > 0


def test_a_model_without_arrivals_is_refused_before_any_request():
    from kvlab.experiments.loadgen.load_run import LoadSpec
    from kvlab.experiments.loadgen.multi import MultiSpec, model_plans
    spec = MultiSpec(Phases(models=2, period_s=0.01, duty=0.1, burst_rate=1.0), LoadSpec())
    with pytest.raises(ConfigError, match="model 0 gets no request"):
        model_plans(spec)
