import dataclasses
import json
import math

import numpy as np
import pytest

from kvlab.common.errors import ConfigError
from kvlab.experiments.cli.main import main
from kvlab.experiments.loadgen.rows import ROW_KEYS
from kvlab.experiments.sim.core import HOST_TIMED, SimCase, SimSettings, run_case
from kvlab.experiments.sim.roofline import hardware, model_spec
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.costs import CUDA_A100, ZERO, CostLedger, StepOps, profile
from kvlab.experiments.sim.serve.run import ServeSpec, parse_backends, plan, run_point
from kvlab.experiments.sim.serve.stats import bootstrap_ratio
from kvlab.experiments.workloads.requests import WorkloadSpec

TIMINGS = set(HOST_TIMED)
SMALL = 300
CASES = [SimCase("reserve", 6.0), SimCase("paged", 6.0, 16, watermark=0.05),
         SimCase("vmm", 6.0, page_size=2 * 2**20, watermark=0.05), SimCase("paged", 6.0, 16)]


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMINGS}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.label}-wm{c.watermark}")
def test_zero_costs_and_arrivals_at_zero_reproduce_the_offline_simulator(case):
    offline = run_case(case, SimSettings(WorkloadSpec(num_requests=SMALL))).to_json()
    served = run_point(case, ServeSpec(num_requests=SMALL), math.inf, 0)
    assert strip(served["sim"]) == strip(offline)
    assert served["completed"] == SMALL and served["failed"] == 0
    assert served["total_output_tokens"] == offline["output_tokens"]
    assert served["duration"] == offline["sim_seconds"]
    assert served["driver"]["driver_seconds"] == 0.0


def test_result_keys_are_bench_serves():
    r = run_point(SimCase("paged", 6.0, 16, watermark=0.05), ServeSpec(num_requests=50, goodput={"ttft": 500}), 4.0, 1)
    assert set(ROW_KEYS) <= set(r)
    assert r["request_goodput"] is not None and r["p99_ttft_ms"] >= r["p50_ttft_ms"] > 0
    # the per-token timestamps are on the simulated clock: TPOT is at least one roofline decode step
    weights_ms = model_spec("llama3-8b").weight_bytes / hardware("h100").bandwidth * 1000
    assert r["p50_tpot_ms"] >= weights_ms and r["p50_itl_ms"] >= weights_ms


def test_paired_seeds_share_arrivals_and_seeds_differ():
    spec = ServeSpec(num_requests=100)
    a, b, c = plan(spec, 3.0, 7), plan(spec, 3.0, 7), plan(spec, 3.0, 8)
    assert a == b and a != c
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    runs = [run_point(case, ServeSpec(num_requests=40), 3.0, 7) for case in CASES[:3]]
    assert len({(r["total_input_tokens"], r["total_output_tokens"]) for r in runs}) == 1


def test_bootstrap_ratio_interval_contains_the_true_ratio():
    rng = np.random.default_rng(0)
    num, den = rng.normal(3.0, 0.3, 40), rng.normal(2.0, 0.2, 40)       # true ratio of means: 1.5
    point, lo, hi = bootstrap_ratio(num.tolist(), den.tolist())
    assert lo < 1.5 < hi and lo < point < hi and hi - lo < 0.3


@pytest.mark.parametrize("knee", [0.37, 13.0, 742.0])
def test_slo_search_finds_a_planted_knee_within_5_percent(knee):
    def service(rate):          # latency flat below the knee, queueing blows up past it
        ttft = 100.0 if rate <= knee else 100.0 + 1e6 * (rate - knee)
        return {"failed": 0, "p99_ttft_ms": ttft, "p99_tpot_ms": 20.0}
    found = slo.search(service, slo.parse_slo("p99_ttft_ms<=2000,p99_tpot_ms<=50"), start=4.0)
    threshold = knee + (2000.0 - 100.0) / 1e6          # where the planted TTFT crosses 2000 ms
    assert found.rate <= threshold and found.rate == pytest.approx(knee, rel=0.05)
    missed = min(r for r, ok in found.evaluations if not ok)
    assert missed > threshold and missed / found.rate - 1 <= 0.02 * (1 + 1e-9)


def test_slo_parse_rejects_bad_items():
    with pytest.raises(Exception, match="KEY<=NUMBER"):
        slo.parse_slo("p99_ttft_ms<2000")


def test_cost_arithmetic_with_and_without_overlap():
    ops = StepOps(pages_mapped=3, map_calls=2, pages_unmapped=1)
    driver = 3 * 1.45e-6 + 2 * 36e-6 + 25.6e-6          # per-run: one cuMemSetAccess per mapped run
    plain = CostLedger(CUDA_A100, set_access="per-run")
    assert plain.charge(ops, compute_s=50e-6) == pytest.approx(driver, abs=1e-15)
    hidden = CostLedger(CUDA_A100, overlap=True, set_access="per-run")
    assert hidden.charge(ops, compute_s=50e-6) == pytest.approx(driver - 50e-6, abs=1e-15)
    assert hidden.charge(ops, compute_s=200e-6) == 0.0
    assert hidden.driver_s == pytest.approx(2 * driver) and hidden.exposed_s == pytest.approx(driver - 50e-6)
    assert hidden.hidden_s == pytest.approx(driver + 50e-6)
    table = CostLedger(CUDA_A100).charge(StepOps(table_bytes=400, kv_read_s=1e-3), compute_s=1e-3)
    assert table == pytest.approx(5e-6 + 400 / 25e9, abs=1e-15)
    assert CostLedger(ZERO).charge(ops, 0.0) == 0.0


def test_set_access_per_page_is_the_default_and_charges_every_page():
    ops = StepOps(pages_mapped=3, map_calls=2, pages_unmapped=1)
    per_page = CostLedger(CUDA_A100)
    assert per_page.set_access == "per-page"
    assert per_page.charge(ops, 0.0) == pytest.approx(3 * 1.45e-6 + 3 * 36e-6 + 25.6e-6, abs=1e-15)
    assert CostLedger(CUDA_A100, set_access="per-run").charge(ops, 0.0) < CostLedger(CUDA_A100).charge(ops, 0.0)


def test_driver_costs_lengthen_vmm_steps_and_overlap_hides_them():
    case = SimCase("vmm", 6.0, page_size=2 * 2**20, watermark=0.05)
    base = ServeSpec(num_requests=60)
    zero = run_point(case, base, 8.0, 0)
    on = run_point(case, ServeSpec(num_requests=60, driver_profile="cuda-a100", background_mapping=False), 8.0, 0)
    hid = run_point(case, ServeSpec(num_requests=60, driver_profile="cuda-a100"), 8.0, 0)   # the default: on
    assert hid["driver"]["background_mapping"] and not on["driver"]["background_mapping"]
    d = on["driver"]
    assert d["driver_seconds"] > 0 and d["driver_exposed_seconds"] == d["driver_seconds"]
    assert on["mean_tpot_ms"] > zero["mean_tpot_ms"]
    assert hid["driver"]["driver_hidden_seconds"] > 0
    assert zero["mean_tpot_ms"] <= hid["mean_tpot_ms"] < on["mean_tpot_ms"]


def test_host_profile_needs_a_calibration(tmp_path):
    with pytest.raises(Exception, match="kvlab calibrate"):
        profile("host", tmp_path / "none.json", 2 * 2**20)


def test_backend_names_parse():
    labels = [c.label for c in parse_backends(["reserve", "paged-16", "vmm-2MiB", "vmm-64KiB"], 60.0, 0.05)]
    assert labels == ["reserve-max", "paged-16", "vmm-2MiB", "vmm-64KiB"]
    with pytest.raises(Exception, match="paged-BLOCK"):
        parse_backends(["paged"], 60.0, 0.05)


def test_cli_grid_and_slo_search(tmp_path, capsys):
    common = ["simulate", "serve", "--backends", "reserve,paged-16", "--num-prompts", "30", "--budget-gb", "6",
              "--jobs", "1", "--no-progress", "--seeds", "2"]
    assert main([*common, "--request-rates", "2,inf", "--out", str(tmp_path / "grid")]) == 0
    assert (tmp_path / "grid" / "sim_serve.csv").is_file() and (tmp_path / "grid" / "sim_pareto.png").is_file()
    from helpers.provenance_check import read_back
    config = read_back(tmp_path / "grid", "sim_serve.json", "simulate serve")
    assert config["cases"] == ["reserve", "paged-16"] and config["seeds"] and config["budget_gb"] == 6
    assert main([*common, "--slo", "p99_ttft_ms<=2000,p99_tpot_ms<=100", "--slo-tolerance", "0.2",
                 "--out", str(tmp_path / "slo")]) == 0
    out = capsys.readouterr().out
    assert "SLO rate" in out and "ratio" in out
    assert (tmp_path / "slo" / "sim_slo_rate.png").is_file()


def test_calibrate_writes_the_host_profile(tmp_path):
    path = tmp_path / "host.json"
    assert main(["calibrate", "--page-sizes", "64KiB", "--pages", "4", "--repeats", "1", "--out", str(path)]) == 0
    prof = profile("host", path, 64 * 2**10)
    assert prof.name == "host" and prof.map_s > 0 and prof.unmap_s > 0
    from helpers.provenance_check import check_provenance
    assert check_provenance(json.loads(path.read_text())["provenance"], "calibrate")["page_sizes"] == ["65536"]
    with pytest.raises(Exception, match="no entry for page size"):
        profile("host", path, 2 * 2**20)
    spec = ServeSpec(num_requests=30, driver_profile="host", calibration=str(path))
    r = run_point(SimCase("vmm", 6.0, page_size=64 * 2**10, watermark=0.05), spec, 4.0, 0)
    assert r["driver"]["driver_profile"] == "host" and r["driver"]["driver_seconds"] > 0


def test_cross_layer_layout_maps_one_page_for_every_layer():
    """vmm-2MiB cross-layer books as per-layer 64 KiB pages (32 tokens each) but issues a 32nd of the calls."""
    per, cross = parse_backends(["vmm-2MiB", "vmm-2MiB-crosslayer"], 6.0, 0.05)
    assert parse_backends(["vmm-2MiB"], 6.0, 0.05, ("per-layer", "cross-layer"))[1].key == cross.key
    spec = ServeSpec(num_requests=40, driver_profile="cuda-a100", background_mapping=False)
    runs = {c.backend_label: run_point(c, spec, 8.0, 0) for c in (per, cross)}
    p, c = runs["vmm-2MiB"], runs["vmm-2MiB-crosslayer"]
    assert p["sim"]["tokens_per_unit"] == 1024 and c["sim"]["tokens_per_unit"] == 32
    assert c["driver"]["driver_seconds"] > 0
    # far fewer tokens per page strand less memory per sequence; the run is otherwise the same workload
    assert c["sim"]["mean_waste_tokens"] < p["sim"]["mean_waste_tokens"]


def test_cross_layer_attention_penalty_is_an_option():
    cross = parse_backends(["vmm-2MiB-crosslayer"], 6.0, 0.05)[0]
    base = ServeSpec(num_requests=30, kernel_costs="vattention-vs-vllm")
    plain, slowed = (run_point(cross, dataclasses.replace(base, layout_penalty=k), 8.0, 0)
                     for k in ("none", "kvcached"))
    assert slowed["sim"]["attention_seconds"] == pytest.approx(1.56 * plain["sim"]["attention_seconds"], rel=0.05)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        run_point(parse_backends(["vmm-64KiB-crosslayer"], 6.0, 0.05)[0], base, 8.0, 0)
