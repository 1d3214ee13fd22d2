"""kvlab study page-size: the turned costs, the break-even searches, the verdict, the CLI and its files, and the
Ray path (slow: a local Ray cluster) against the process pool."""
import csv
import json
import math
from dataclasses import replace

import pytest

from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.kernels import kernel_profile
from kvlab.experiments.sim.serve.run import ServeSpec
from kvlab.experiments.sim.serve.run import run_point as serve_point
from kvlab.experiments.studies.page_size import flips as fl
from kvlab.experiments.studies.page_size.point import FLAT, Costs, kernel_spec, run_point, scaled
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings
from kvlab.experiments.studies.page_size.study import run_study
from kvlab.experiments.studies.page_size.verdict import verdict

PAGED = SimCase("paged", 1.0, 16, watermark=0.05)
VMM = SimCase("vmm", 1.0, page_size=2 * 2**20, watermark=0.05)
SPEC = ServeSpec(num_requests=30, model_prefill=True, driver_profile="cuda-h200")
TINY = ["study", "page-size", "--num-prompts", "12", "--seeds", "2", "--paged-blocks", "16",
        "--vmm-pages", "2MiB", "--budget-gb", "1", "--no-progress"]


@pytest.mark.parametrize("kernel", ["none", "published"])
def test_todays_costs_are_simulate_serves_run(kernel, tmp_path):
    spec = replace(SPEC, kernel_costs=kernel)
    mine = run_point(PAGED, kernel_spec(spec, kernel_profile(kernel), Costs(), tmp_path), Costs(), 8.0, 1, None)
    theirs = serve_point(PAGED, spec, 8.0, 1)
    for key in ("p99_ttft_ms", "p99_tpot_ms", "output_throughput", "duration", "completed"):
        assert mine[key] == theirs[key]


def test_the_kernel_scale_slows_paged_only_and_the_driver_scale_vmm_only(tmp_path):
    base = kernel_profile("published")

    def duration(case, costs):
        return run_point(case, kernel_spec(SPEC, base, costs, tmp_path), costs, 8.0, 1, None)["duration"]
    assert duration(PAGED, Costs(kernel_scale=3.0)) > duration(PAGED, Costs())
    assert duration(PAGED, Costs(driver_scale=50.0)) == duration(PAGED, Costs())
    assert duration(VMM, Costs(driver_scale=50.0)) > duration(VMM, Costs())
    assert duration(VMM, Costs(kernel_scale=3.0)) == duration(VMM, Costs())


def test_a_scaled_profile_scales_the_slowdown_not_the_ideal():
    twice = scaled(kernel_profile("published"), 2.0)
    assert twice.ratio("decode", 16, 4096) == pytest.approx(1 + 2 * 0.97)
    assert scaled(FLAT, 0.0).ratio("prefill", 128, 100) == 1.0


class FakeProbe:
    """Paged's best rate falls as 10 / (1 + kernel scale); vmm's as `vmm0` - scale / 2."""
    today_scale = 1.0

    def __init__(self, vmm0: float) -> None:
        self.vmm0 = vmm0

    def best_paged(self, kernel_scale: float) -> float:
        return 10 / (1 + kernel_scale)

    def decode_slowdown(self, kernel_scale: float) -> float:
        return 1 + kernel_scale

    def vmm(self, case, driver_scale: float) -> float:
        return self.vmm0 - driver_scale / 2


def test_break_even_brackets_the_kernel_scale_where_vmm_overtakes():
    lo, hi = fl.break_even_kernel(FakeProbe(4.6), VMM)         # 10 / (1 + k) = 4.1 at k = 1.439
    assert lo < 10 / 4.1 - 1 < hi and hi / lo - 1 <= fl.KERNEL_TOL * 1.01


def test_driver_flip_brackets_the_scale_where_the_lead_changes_at_todays_kernels():
    lo, hi = fl.driver_flip(FakeProbe(5.3), VMM)                 # paged 5 today; vmm 5.3 - s / 2 = 5 at s = 0.6
    assert lo <= 0.6 < hi and hi / lo - 1 <= fl.SCALE_TOL * 1.01
    assert fl.driver_flip(FakeProbe(4.9), VMM) == [0.0, fl.SCALE_LOW]
    probe = FakeProbe(7.0)                                       # vmm 7 - s / 2 = 5 at s = 4
    result = fl.flips(probe, VMM, has_driver_costs=True)
    assert result["leads_today"]
    lo, hi = result["driver_flip_scale"]
    assert lo <= 4.0 < hi and hi / lo - 1 <= fl.SCALE_TOL * 1.01


def test_a_leader_today_and_a_unit_that_never_leads():
    leader = fl.flips(FakeProbe(7.0), VMM, has_driver_costs=True)   # 6.5 > 10 / 2
    lo, hi = leader["break_even_kernel_scale"]
    assert lo < 10 / 6.5 - 1 < hi
    never = fl.flips(FakeProbe(0.4), VMM, has_driver_costs=True)
    assert never["break_even_kernel_scale"][1] == math.inf and never["driver_flip_scale"][0] == 0
    assert fl.flips(FakeProbe(4.6), VMM, has_driver_costs=False)["driver_flip_scale"] is None


def unit(rate, ci, tokens, ratio, ratio_ci):
    return {"slo_rate": rate, "slo_rate_ci95": ci, "output_throughput": rate * 100, "tokens_per_unit": tokens,
            "ratio_to_best_paged": {"ratio": ratio, "ci95": ratio_ci}}


def flip(leads, kernel, slowdown, scale):
    return {"leads_today": leads, "kernel_scale_today": 1.0, "decode_slowdown_today": 1.97,
            "break_even_kernel_scale": kernel, "break_even_decode_slowdown": slowdown, "driver_flip_scale": scale}


def test_the_verdict_follows_the_numbers():
    cell = {"best_paged": "paged-16", "units": {"paged-16": unit(10, [9, 11], 16, 1, [1, 1]),
                                                "vmm-2MiB": unit(5, [4, 6], 1024, 0.5, [0.4, 0.6])},
            "flips": {"vmm-2MiB": flip(False, [2.0, 2.2], [2.94, 3.13], [0.3, 0.4])}}
    text = verdict({"driver p": cell})
    assert "paged-16 (16 tokens per unit) serves the highest rate" in text and "beyond the 95%" in text
    assert "overtakes once paged decode attention is 2.94-3.13x as slow" in text
    assert "(the profile's: 1.97x)" in text and "lead only with driver calls at 0.3-0.4x its latency" in text
    cell["units"]["vmm-2MiB"] = unit(12, [8, 13], 1024, 1.2, [0.9, 1.3])
    cell["flips"]["vmm-2MiB"] = flip(True, [0.0, 0.01], [1.0, 1.01], [64.0, math.inf])
    assert "trails even with driver calls 4x faster" in verdict({"p": {**cell, "flips": {
        "vmm-2MiB": flip(False, [0.5, 0.6], [1.5, 1.6], [0.0, 0.25])}}})
    text = verdict({"driver p": cell})
    assert "vmm-2MiB (1024 tokens per unit) serves" in text and "within the 95%" in text
    assert "no significant difference" in text and "leads even with paged kernels as fast" in text
    assert "keeps its lead with driver calls 64x" in text
    cell["units"] = {u: unit(131072, [131072, 131072], 16, 1, [1, 1]) for u in cell["units"]}
    assert "never loads the server" in verdict({"driver p": cell})


@pytest.mark.parametrize("flags, message", [
    (["--kernel-costs", "bogus"], "unknown --kernel-costs 'bogus'"),
    (["--driver-costs", "bogus"], "unknown --driver-costs 'bogus'"),
    (["--paged-blocks", "16,x"], "--paged-blocks takes positive integers"),
    (["--tensor-parallel-sizes", "3"], "tensor"),
    (["--dataset", "nope"], "unknown --dataset-name 'nope'"),
    (["--vmm-pages", "2MiB,lots"], "bad size 'lots'"),
    (["--ray", "127.0.0.1:1"], "Ray"),
])
def test_errors_are_one_line_and_exit_2(capsys, flags, message):
    assert main([*TINY, "--no-save", "--no-flips", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_the_cli_writes_json_csv_plot_and_a_verdict(tmp_path, capsys):
    assert main([*TINY, "--out", str(tmp_path), "--no-flips"]) == 0
    assert "Verdict: Under driver cuda-h200, kernel published" in capsys.readouterr().out
    doc = json.loads((tmp_path / "study.json").read_text())
    cell = doc["cells"]["driver cuda-h200, kernel published"]
    assert set(cell["units"]) == {"paged-16", "vmm-2MiB"} and len(cell["searches"]) == 4
    rows = list(csv.DictReader((tmp_path / "study.csv").open()))
    assert [r["unit"] for r in rows] == ["paged-16", "vmm-2MiB"]
    assert "slo_rate_req_per_s" in rows[0] and "output_throughput_tok_per_s" in rows[0]
    assert (tmp_path / "study.png").stat().st_size > 0


def tiny_settings(ray: str | None) -> StudySettings:
    spec = ServeSpec(num_requests=12, model_prefill=True)
    return StudySettings(spec, {"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}, (0, 1), (Cell("cuda-h200", "published"),),
                         (16,), (2 * 2**20,), budget_gb=1.0, jobs=2, ray=ray, progress=False, save=False)


@pytest.mark.slow
def test_ray_gives_the_pools_results():
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvlab[ray]')")
    import ray
    pool = run_study(tiny_settings(None))
    try:
        on_ray = run_study(tiny_settings("local"))
    finally:
        ray.shutdown()
    assert on_ray["cells"] == pool["cells"] and on_ray["verdict"] == pool["verdict"]
