"""`kvlab simulate pool`: N engines on one GPU, one elastic pool against static splits. Arithmetic checked by hand
on small cases: the on/off rates, the memory after weights, the pool's books (never over its pages, every page
moved charged once), and one model without bursts giving the same answer on the pool as on a static split."""
import math

import pytest

from kvlab.experiments.cli.main import main
from kvlab.experiments.loadgen.latency import RequestRecord
from kvlab.experiments.sim.gpu_figures import kv_budget_gb
from kvlab.experiments.sim.pool import shared
from kvlab.experiments.sim.pool.onoff import OnOff
from kvlab.experiments.sim.pool.run import PoolSpec, attainment, parse_arrangements, run_point, worst_of
from kvlab.experiments.sim.roofline import model_spec
from kvlab.experiments.sim.serve.run import ServeSpec

SMALL = ServeSpec(dataset="random", input_len=200, output_len=40, range_ratio=0.5, model_prefill=True,
                  driver_profile="cuda-a100", background_mapping=False)     # simulate pool's default
SLO = {"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}


def test_on_off_windows_and_rates_by_hand():
    o = OnOff(models=3, period_s=60, periods=2)
    assert o.burst_rate(9.0) == 9.0                    # one model at a time sends the whole rate
    assert o.windows(1, 9.0) == [(20.0, 40.0, 9.0), (80.0, 100.0, 9.0)]
    half = OnOff(models=2, period_s=10, periods=1, duty=0.5, idle_share=0.25)
    burst = half.burst_rate(4.0)                       # per model 2/s = b (0.25 + 0.25 x 0.75)
    assert burst == pytest.approx(2.0 / (0.25 + 0.25 * 0.75))
    for model in range(2):                             # every model sends total / N on average
        sent = sum((end - start) * rate for start, end, rate in half.windows(model, 4.0))
        assert sent / half.duration_s == pytest.approx(2.0)
    times = o.arrivals(2, 9.0, seed=3)
    assert times == o.arrivals(2, 9.0, seed=3) and all(40 <= t < 60 or 100 <= t < 120 for t in times)


def test_memory_after_weights():
    weights = model_spec("llama3-8b").weight_bytes
    assert kv_budget_gb("h100", "llama3-8b", 1) == pytest.approx((80e9 * 0.95 - weights) / 1e9)
    assert kv_budget_gb("h100", "llama3-8b", 1) == pytest.approx(59.9, abs=0.1)    # the presets' 60 GB
    assert kv_budget_gb("h100", "llama3-8b", 3) == pytest.approx((76e9 - 3 * weights) / 1e9)


def test_one_model_without_bursts_agrees_on_the_pool_and_the_split():
    spec = PoolSpec(SMALL, OnOff(models=1, period_s=20, periods=1), SLO)
    shared_run, split_run = (run_point(a, spec, 6.0, 0) for a in parse_arrangements(
        ["shared:vmm-64KiB", "split:vmm-64KiB"], 0.3, 0.05))
    assert shared_run["num_prompts"] > 50 and shared_run["pages_moved"] == 0
    strip = lambda r: {k: v for k, v in r.items() if k not in ("arrangement", "per_model")}   # noqa: E731
    assert strip(shared_run) == strip(split_run)
    assert shared_run["per_model"][0]["server_preemptions"] == split_run["per_model"][0]["server_preemptions"]


@pytest.mark.parametrize("kind", ["shared", "aware"])
def test_the_pool_never_lends_more_than_it_has_and_every_moved_page_is_received_once(kind, monkeypatch):
    seen = []
    check = shared.PoolShare.check

    def watched(self, delta, call):
        check(self, delta, call)                  # passed: the map fits
        seen.append(self.pool.held + max(delta, 0) <= self.pool.pages)
    monkeypatch.setattr(shared.PoolShare, "check", watched)
    spec = PoolSpec(SMALL, OnOff(models=2, period_s=10, periods=2), SLO)
    arr = parse_arrangements([f"{kind}:vmm-64KiB"], 0.25, 0.05)[0]
    r = run_point(arr, spec, 14.0, 1)
    assert seen and all(seen)
    assert r["pages_moved"] > 0 and sum(m["pages_received"] for m in r["per_model"]) == r["pages_moved"]
    # as built, an engine with nothing running fails a request that others' pages keep out ("does not fit even
    # in an empty cache"); aware, it waits for them
    assert (r["failed"] == 0) == (kind == "aware")


def test_split_engines_each_get_an_equal_share():
    split = parse_arrangements(["split:paged-16"], 30.0, 0.05)[0]
    assert split.engine_case(3).budget_gb == 10.0 and split.engine_case(3).options == {"block_size": 16}
    pooled = parse_arrangements(["aware:vmm-2MiB"], 30.0, 0.05)[0]
    assert pooled.engine_case(3).budget_gb == 30.0 and pooled.label == "aware vmm-2MiB"


def test_attainment_and_worst_by_hand():
    fast = RequestRecord(success=True, output_tokens=3, ttft=0.5, latency=0.7)          # tpot 0.1 s
    slow = RequestRecord(success=True, output_tokens=3, ttft=2.5, latency=2.7)
    late = RequestRecord(success=True, output_tokens=3, ttft=0.5, latency=1.5)         # tpot 0.5 s
    assert attainment([fast, slow, late, fast], {"ttft": 2000, "tpot": 200}) == 0.5
    assert attainment([fast], {}) is None
    assert PoolSpec(SMALL, OnOff(2), {"p99_ttft_ms": 2000, "p50_e2el_ms": 9}).request_limits == {"ttft": 2000}
    goodput = ServeSpec(goodput={"tpot": 50.0, "e2el": 9.0})
    assert PoolSpec(goodput, OnOff(2), {"p99_ttft_ms": 2000}).request_limits == {"tpot": 50.0}
    assert worst_of([1.0, math.nan, 3.0]) == 3.0 and math.isnan(worst_of([math.nan]))


COMMON = ["simulate", "pool", "--models", "2", "--budget-gb", "0.3", "--dataset", "random", "--input-len", "200",
          "--output-len", "40", "--period-s", "10", "--periods", "1", "--jobs", "1", "--no-progress",
          "--arrangements", "shared:vmm-64KiB,split:paged-16"]


def test_cli_grid(capsys):
    assert main([*COMMON, "--total-rates", "4", "--goodput", "ttft:2000", "tpot:100", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "shared vmm-64KiB" in out and "model 1" in out


@pytest.mark.slow
def test_cli_search(tmp_path, capsys):
    assert main([*COMMON, "--slo", "p99_ttft_ms<=2000,p99_tpot_ms<=100", "--slo-tolerance", "0.3",
                 "--out", str(tmp_path / "new" / "dir")]) == 0
    assert "SLO total rate" in capsys.readouterr().out and (tmp_path / "new" / "dir" / "sim_pool.json").is_file()


@pytest.mark.parametrize("argv,fragment", [
    (["--arrangements", "shared:paged-16"], "only vmm engines can share a pool"),
    (["--arrangements", "pooled:vmm-2MiB"], "bad arrangement"),
    (["--models", "5"], "do not fit on one h100"),
    (["--models", "0"], "--models"),
    (["--duty", "0"], "--duty"),
    (["--driver-costs", "fast"], "unknown --driver-costs"),
    (["--slo", "p99_foo_ms<=3"], "not a latency result key"),
])
def test_errors_are_one_line(argv, fragment, capsys):
    assert main(["simulate", "pool", "--no-save", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]
