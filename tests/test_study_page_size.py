"""kvlab study page-size: the turned costs, the kernel-ratio curve and its break-even, the driver flip, the verdict,
the CLI and its files (provenance, journal, resume after an interrupt), and the Ray path (slow: a local Ray
cluster) against the process pool."""
import csv
import json
from dataclasses import replace

import pytest

from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.kernels import kernel_profile
from kvlab.experiments.sim.serve.run import ServeSpec
from kvlab.experiments.sim.serve.run import run_point as serve_point
from kvlab.experiments.studies.page_size import curve as cv
from kvlab.experiments.studies.page_size import flips as fl
from kvlab.experiments.studies.page_size.point import FLAT, Costs, curve_shape, kernel_spec, run_point, scaled
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings, unit_label
from kvlab.experiments.studies.page_size.study import run_study
from kvlab.experiments.studies.page_size.verdict import verdict

PAGED = SimCase("paged", 1.0, 16, watermark=0.05)
VMM = SimCase("vmm", 1.0, page_size=2 * 2**20, watermark=0.05)
SPEC = ServeSpec(num_requests=30, model_prefill=True, driver_profile="cuda-a100")
TINY = ["study", "page-size", "--num-prompts", "12", "--seeds", "2", "--paged-blocks", "16",
        "--vmm-pages", "2MiB", "--budget-gb", "1", "--no-progress", "--kernel-costs", "vattention-vs-vllm"]


@pytest.mark.parametrize("kernel", ["none", "vattention-vs-vllm"])
def test_todays_costs_are_simulate_serves_run(kernel, tmp_path):
    spec = replace(SPEC, kernel_costs=kernel)
    mine = run_point(PAGED, kernel_spec(spec, kernel_profile(kernel), Costs(), tmp_path), Costs(), 8.0, 1, None)
    theirs = serve_point(PAGED, spec, 8.0, 1)
    for key in ("p99_ttft_ms", "p99_tpot_ms", "output_throughput", "duration", "completed"):
        assert mine[key] == theirs[key]


def test_the_kernel_scale_slows_paged_only_and_the_driver_scale_vmm_only(tmp_path):
    base = kernel_profile("vattention-vs-vllm")

    def duration(case, costs):
        return run_point(case, kernel_spec(SPEC, base, costs, tmp_path), costs, 8.0, 1, None)["duration"]
    assert duration(PAGED, Costs(kernel_scale=3.0)) > duration(PAGED, Costs())
    assert duration(PAGED, Costs(driver_scale=50.0)) == duration(PAGED, Costs())
    assert duration(VMM, Costs(driver_scale=50.0)) > duration(VMM, Costs())
    assert duration(VMM, Costs(kernel_scale=3.0)) == duration(VMM, Costs())


def test_a_scaled_profile_scales_the_slowdown_not_the_ideal():
    twice = scaled(kernel_profile("vattention-vs-vllm"), 2.0)
    assert twice.ratio("decode", 16, 4096) == pytest.approx(1 + 2 * 0.97)
    assert scaled(FLAT, 0.0).ratio("prefill", 128, 100) == 1.0


class FakeProbe:
    """Paged's best rate is 5; vmm's falls as `vmm0` - driver scale / 2."""

    def __init__(self, vmm0: float) -> None:
        self.vmm0 = vmm0

    def best_paged(self) -> float:
        return 5.0

    def vmm(self, case, driver_scale: float) -> float:
        return self.vmm0 - driver_scale / 2


def test_driver_flip_brackets_the_scale_where_the_lead_changes_at_todays_kernels():
    lo, hi = fl.driver_flip(FakeProbe(5.3), VMM)                 # paged 5; vmm 5.3 - s / 2 = 5 at s = 0.6
    assert lo <= 0.6 < hi and hi / lo - 1 <= fl.SCALE_TOL * 1.01
    assert fl.driver_flip(FakeProbe(4.9), VMM) == [0.0, fl.SCALE_LOW]
    result = fl.flips(FakeProbe(7.0), VMM)                       # vmm 7 - s / 2 = 5 at s = 4
    assert result["leads_today"]
    lo, hi = result["driver_flip_scale"]
    assert lo <= 4.0 < hi and hi / lo - 1 <= fl.SCALE_TOL * 1.01


def unit(rate, ci, tokens, ratio, ratio_ci):
    return {"slo_rate": rate, "slo_rate_ci95": ci, "output_throughput": rate * 100, "tokens_per_unit": tokens,
            "ratio_to_best_paged": {"ratio": ratio, "ci95": ratio_ci}}


def curve_of(points):
    """points: (r, mean, low, high) of vmm-2MiB / best paged."""
    pts = [{"kernel_ratio": r, "best_paged": "paged-16", "vmm": {"vmm-2MiB": {"ratio": m, "ci95": [lo, hi]}}}
           for r, m, lo, hi in points]
    return {"points": pts, "break_even": cv.break_evens(pts, ["vmm-2MiB"])}


def test_the_verdict_follows_the_numbers():
    cell = {"best_paged": "paged-16", "kernel_ratio_today": 1.23,
            "units": {"paged-16": unit(10, [9, 11], 16, 1, [1, 1]), "vmm-2MiB": unit(5, [4, 6], 1024, 0.5, [0.4, 0.6])},
            "curve": curve_of([(1.0, 0.8, 0.7, 0.9), (1.5, 1.0, 0.9, 1.1), (2.0, 1.2, 1.1, 1.3)])}
    text = verdict({"driver p": cell})
    assert "paged-16 (16 tokens per unit) serves the highest rate" in text and "beyond the 95%" in text
    assert "charges paged-16 decode 1.23x contiguous" in text
    assert "vmm-2MiB leads the best paged block above r* = 1.5 [1.25, 1.75]" in text
    cell["curve"] = curve_of([(1.0, 0.98, 0.9, 1.05), (2.0, 1.02, 0.95, 1.1)])
    assert "vmm-2MiB is not distinguishable from the best paged block anywhere on r = 1-2" in verdict({"p": cell})
    cell["curve"] = curve_of([(1.0, 0.5, 0.4, 0.6), (2.0, 0.7, 0.6, 0.8)])
    assert "trails the best paged block at every r up to 2" in verdict({"p": cell})
    cell["curve"] = curve_of([(1.0, 1.2, 1.1, 1.3), (2.0, 1.5, 1.4, 1.6)])
    assert "leads the best paged block already at r = 1" in verdict({"p": cell})
    cell["units"] = {u: unit(131072, [131072, 131072], 16, 1, [1, 1]) for u in cell["units"]}
    assert "never loads the server" in verdict({"driver p": cell})


def test_the_crossing_of_a_known_line_is_found_exactly():
    xs = [1.0, 1.25, 1.5, 1.75, 2.0]
    mean = [0.8 + 0.4 * (x - 1) for x in xs]                  # 1 at r = 1.5
    b = cv.break_even(xs, mean, [m - 0.1 for m in mean], [m + 0.1 for m in mean])
    assert b["status"] == "crosses" and b["r_star"] == pytest.approx(1.5)
    assert b["ci95"] == pytest.approx([1.25, 1.75])          # band edges reach 1 at 1.25 and 1.75
    wide = cv.break_even(xs, mean, [m - 0.3 for m in mean], [m + 0.1 for m in mean])
    assert wide["ci95"][1] is None and wide["status"] == "crosses"   # lower edge 0.9 at 2: never clears the tie
    assert cv.crossing([1.0, 2.0], [0.5, 0.9]) is None and cv.crossing([1.0, 2.0], [1.1, 0.9]) == 1.0


def test_a_curve_point_pairs_vmm_with_the_best_paged_unit_at_that_ratio():
    rates = {"paged-16": [4.0, 4.4], "paged-128": [5.0, 5.0], "vmm-2MiB": [5.0, 5.5]}
    p = cv.curve_point(1.5, rates, ["paged-16", "paged-128"], ["vmm-2MiB"])
    assert p["best_paged"] == "paged-128" and p["vmm"]["vmm-2MiB"]["ratio"] == pytest.approx(1.05)


def test_the_curve_shape_puts_the_reference_ratio_where_asked():
    for name in ("central", "vattention-vs-vllm", "fa2-same-kernel", "none"):
        shape = curve_shape(kernel_profile(name))
        for r in (1.0, 1.4, 2.0):
            assert scaled(shape, cv.scale_for(shape, r)).ratio("decode", 16, 4096) == pytest.approx(r)
    central = curve_shape(kernel_profile("central"))
    at_2 = scaled(central, cv.scale_for(central, 2.0))
    assert at_2.ratio("decode", 256, 4096) == pytest.approx(1.0)
    assert 1.0 < at_2.ratio("decode", 128, 4096) < 2.0


@pytest.mark.parametrize("flags, message", [
    (["--kernel-costs", "bogus"], "unknown --kernel-costs 'bogus'"),
    (["--driver-costs", "bogus"], "unknown --driver-costs 'bogus'"),
    (["--paged-blocks", "16,x"], "--paged-blocks takes distinct positive integers"),
    (["--elastic-blocks", "16,0"], "--elastic-blocks takes distinct positive integers"),
    (["--tensor-parallel-sizes", "3"], "tensor"),
    (["--dataset", "nope"], "unknown --dataset-name 'nope'"),
    (["--vmm-pages", "2MiB,lots"], "bad size 'lots'"),
    (["--ray", "127.0.0.1:1"], "Ray"),
    (["--vmm-layout", "diagonal"], "unknown vmm layout 'diagonal'"),
])
def test_errors_are_one_line_and_exit_2(capsys, flags, message):
    assert main([*TINY, "--no-save", "--no-flips", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_the_cli_writes_json_csv_plot_and_a_verdict(tmp_path, capsys):
    assert main([*TINY, "--out", str(tmp_path), "--no-flips"]) == 0
    assert "Verdict: Under driver cuda-a100, kernel vattention-vs-vllm" in capsys.readouterr().out
    doc = json.loads((tmp_path / "study.json").read_text())
    cell = doc["cells"]["driver cuda-a100, kernel vattention-vs-vllm"]
    assert set(cell["units"]) == {"paged-16", "vmm-2MiB"} and len(cell["searches"]) == 4
    rows = list(csv.DictReader((tmp_path / "study.csv").open()))
    assert [r["unit"] for r in rows] == ["paged-16", "vmm-2MiB"]
    assert "slo_rate_req_per_s" in rows[0] and "output_throughput_tok_per_s" in rows[0]
    assert (tmp_path / "study.png").stat().st_size > 0


CURVE = [*TINY, "--kernel-ratios", "1,1.5,2", "--jobs", "1"]


def test_a_cross_layer_unit_is_a_column_of_its_own(tmp_path, capsys):
    """--vmm-layout per-layer,cross-layer: each vmm page size is searched in both layouts, labelled apart; the
    cross-layer unit holds L times fewer tokens per page."""
    assert main([*TINY, "--out", str(tmp_path), "--no-flips", "--vmm-layout", "per-layer,cross-layer",
                 "--layout-penalty", "kvcached", "--seeds", "1", "--paged-blocks", "128", "--no-plots"]) == 0
    assert "cross-layer attention penalty kvcached" in capsys.readouterr().out
    cell = json.loads((tmp_path / "study.json").read_text())["cells"]
    units = next(iter(cell.values()))["units"]
    assert set(units) == {"paged-128", "vmm-2MiB", "vmm-2MiB-crosslayer"}
    per, cross = units["vmm-2MiB"]["tokens_per_unit"], units["vmm-2MiB-crosslayer"]["tokens_per_unit"]
    assert per == 32 * cross


def fake_search(job):
    """A search without the simulator: paged-16 serves 10 / r req/s at kernel ratio r, vmm-2MiB 7 (+ 0.1 a seed),
    so vmm overtakes at r = 10 / 7.05 ~ 1.418 on average over seeds 0 and 1."""
    from kvlab.experiments.studies.page_size.settings import unit_label
    r0 = cv.reference_ratio(curve_shape(job.kernel))
    k = job.costs.kernel_scale
    r = cv.reference_ratio(job.kernel) if k is None else 1 + k * (r0 - 1)
    unit = unit_label(job.case)
    rate = 10 / r if unit.startswith("paged") else 7 + 0.1 * job.seed
    return {"cell": job.cell.label, "unit": unit, "seed": job.seed, "kernel_scale": k,
            "driver_scale": job.costs.driver_scale, "slo_rate": rate, "output_throughput": rate * 100,
            "tokens_per_unit": 16 if unit.startswith("paged") else 1024, "runs": 1}


@pytest.fixture
def fake(monkeypatch):
    from kvlab.experiments.studies.page_size import probe
    ran = []
    monkeypatch.setattr(probe, "search", lambda job: ran.append(job) or fake_search(job))
    return ran


def study_doc(folder):
    doc = json.loads((folder / "study.json").read_text())
    doc.pop("host_seconds")
    doc["settings"].pop("out")
    return doc


def test_the_curve_run_finds_the_known_crossing_and_writes_provenance_journal_and_plot(tmp_path, capsys, fake):
    assert main([*CURVE, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vmm/paged SLO rate against r" in out and "r = 1.97: vAttention" in out
    assert "driver profile cuda-a100: ovg-project/kvcached" in out
    be = study_doc(tmp_path)["cells"]["driver cuda-a100, kernel vattention-vs-vllm"]["curve"]["break_even"]
    assert be["vmm-2MiB"]["status"] == "crosses"
    # the curve is linear between its points: 0.705 at 1, 1.0575 at 1.5 -> the tie at 1 + 0.5 x 0.295 / 0.3525
    assert be["vmm-2MiB"]["r_star"] == pytest.approx(1 + 0.5 * 0.295 / 0.3525)
    assert "vmm-2MiB leads the best paged block above r* = 1.42" in out
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["config"]["command"] == "study page-size" and prov["config"]["args"]["kernel_ratios"] == [1, 1.5, 2]
    lines = (tmp_path / "searches.jsonl").read_text().splitlines()
    assert len(lines) == len(fake) == 4 + 3 * 2     # the grid (2 units x 2 seeds), paged-16 x 2 seeds at 3 ratios
    rows = list(csv.DictReader((tmp_path / "curve.csv").open()))
    assert [float(r["kernel_ratio_paged_over_contiguous"]) for r in rows] == [1.0, 1.5, 2.0]
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_an_interrupted_study_reports_what_it_has_and_resume_finishes_it(tmp_path, capsys, monkeypatch, fake):
    from kvlab.experiments.studies.page_size.journal import Journal
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main([*CURVE, "--out", str(full)]) == 0
    add = Journal.add

    def add_then_stop(self, r):
        add(self, r)
        if len(self.done) == 5:
            raise KeyboardInterrupt
    monkeypatch.setattr(Journal, "add", add_then_stop)
    assert main([*CURVE, "--out", str(cut)]) == 130
    assert "INTERRUPTED after 5 searches" in (cut / "report.txt").read_text()
    assert f"kvlab study page-size --resume {cut}" in capsys.readouterr().err
    assert len((cut / "searches.jsonl").read_text().splitlines()) == 5
    monkeypatch.setattr(Journal, "add", add)
    fake.clear()
    assert main(["study", "page-size", "--resume", str(cut), "--no-progress", "--jobs", "1"]) == 0
    assert len(fake) == 10 - 5 and study_doc(cut) == study_doc(full)
    assert main(["study", "page-size", "--resume", str(tmp_path / "nothing")]) == 2


def tiny_settings(ray: str | None) -> StudySettings:
    spec = ServeSpec(num_requests=12, model_prefill=True)
    return StudySettings(spec, {"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}, (0, 1),
                         (Cell("cuda-a100", "vattention-vs-vllm"),), (16,), (2 * 2**20,), budget_gb=1.0, jobs=2,
                         ray=ray, progress=False, save=False)


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


@pytest.mark.slow
def test_sigterm_leaves_a_partial_report_and_exit_130(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "study"
    argv = [sys.executable, "-m", "kvlab.experiments.cli.main", *TINY[:-2], "--kernel-ratios", "1,2",
            "--jobs", "2", "--out", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    journal = out / "searches.jsonl"
    deadline = time.monotonic() + 300
    while not (journal.is_file() and journal.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err       # the pool's workers end quietly
    assert "INTERRUPTED after" in (out / "report.txt").read_text() and "interrupted" in err.splitlines()[-1]


ELASTIC = SimCase("elastic", 1.0, watermark=0.05, elastic_block_size=16, elastic_page_size=2 * 2**20)


def test_an_elastic_unit_pays_the_paged_kernel_and_the_driver(tmp_path):
    """elastic runs paged kernels over mapped pages: both turned costs reach it."""
    base, spec = kernel_profile("vattention-vs-vllm"), replace(SPEC, num_requests=16)

    def duration(costs):
        return run_point(ELASTIC, kernel_spec(spec, base, costs, tmp_path), costs, 8.0, 1, None)["duration"]
    today = duration(Costs())
    assert duration(Costs(kernel_scale=3.0)) > today
    assert duration(Costs(driver_scale=500.0)) > today


def test_the_elastic_arm_is_one_unit_per_block_and_page_and_off_by_default():
    s = StudySettings(SPEC, {}, (0,), (Cell("zero", "none"),), (16,), (64 * 1024, 2 * 2**20))
    assert [unit_label(c) for c in s.cases()] == ["paged-16", "vmm-64KiB", "vmm-2MiB"]
    s = replace(s, elastic_blocks=(16, 32))
    assert [unit_label(c) for c in s.cases()][3:] == ["elastic-16-64KiB", "elastic-16-2MiB", "elastic-32-64KiB",
                                                     "elastic-32-2MiB"]


def test_the_elastic_effects_pair_elastic_with_its_block_and_vmm_with_its_page():
    from kvlab.experiments.studies.page_size.elasticity import effects
    rates = {"paged-16": [10.0, 12.0], "paged-128": [11.0, 13.0], "vmm-2MiB": [8.0, 9.0],
             "elastic-16-2MiB": [9.0, 10.8], "elastic-32-2MiB": [5.0, 6.0]}
    found = {(e["effect"], e["over"]): e for e in effects(rates, "paged-128")}
    same = found["elasticity, paged layout", "elastic-16-2MiB / paged-16"]
    assert same["ratio"] == pytest.approx(0.9) and same["ci95"] == pytest.approx([0.9, 0.9])
    assert found["elasticity, paged layout", "elastic-32-2MiB / paged-128"]["ratio"] == pytest.approx(11 / 24)
    assert found["contiguity, elastic memory", "vmm-2MiB / elastic-16-2MiB"]["ratio"] == pytest.approx(17 / 19.8)
    assert len(found) == 4


def elastic_fake_search(job):
    """fake_search, with elastic-16-2MiB serving 0.9x paged-16's rate at every seed."""
    found = fake_search(job)
    if found["unit"].startswith("elastic-"):
        paged = fake_search(replace(job, case=PAGED))
        found.update(slo_rate=0.9 * paged["slo_rate"], output_throughput=90 * paged["slo_rate"], tokens_per_unit=16)
    return found


def test_the_cli_elastic_arm_splits_layout_from_elasticity(tmp_path, capsys, monkeypatch):
    from kvlab.experiments.studies.page_size import probe
    ran = []
    monkeypatch.setattr(probe, "search", lambda job: ran.append(job) or elastic_fake_search(job))
    flags = ["--no-flips", "--no-plots", "--elastic-blocks", "16", "--jobs", "1"]
    assert main([*TINY, "--out", str(tmp_path), *flags]) == 0
    out = capsys.readouterr().out
    assert "layout and elasticity apart" in out
    assert "elasticity, paged layout elastic-16-2MiB / paged-16 = 0.900 [0.900, 0.900]" in out
    cell = study_doc(tmp_path)["cells"]["driver cuda-a100, kernel vattention-vs-vllm"]
    assert set(cell["units"]) == {"paged-16", "vmm-2MiB", "elastic-16-2MiB"} and len(ran) == 6
    vmm_over_elastic = next(e for e in cell["elastic_effects"] if e["effect"] == "contiguity, elastic memory")
    paged = 10 / cv.reference_ratio(kernel_profile("vattention-vs-vllm"))
    assert vmm_over_elastic["ratio"] == pytest.approx(7.05 / (0.9 * paged))
    rows = list(csv.DictReader((tmp_path / "study.csv").open()))
    assert [r["unit"] for r in rows] == ["paged-16", "vmm-2MiB", "elastic-16-2MiB"]
