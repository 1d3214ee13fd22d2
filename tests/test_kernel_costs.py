"""The simulator's kernel term (issue 26.1): `none` is today's roofline exactly; attention grows with context and
is in seconds; paged at block 16 costs at least the contiguous time under `vattention-vs-vllm`; a measured profile
round-trips through its file (calibrate, and the GPU check's dry run); a bad profile is one line, exit 2; every
row reports where its step time went."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvlab.common.errors import ConfigError
from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.core import SimCase, SimSettings, run_case
from kvlab.experiments.sim.kernel_evidence import VATTENTION_VS_VLLM
from kvlab.experiments.sim.kernels import KernelTerm, kernel_profile, parse_profile, read_profile
from kvlab.experiments.sim.roofline import RooflineCost, RooflineRunner, hardware, model_spec
from kvlab.experiments.sim.serve.run import ServeSpec, run_point
from kvlab.experiments.workloads.requests import WorkloadSpec

COST = RooflineCost(hardware("h100"), model_spec("llama3-8b"), model_prefill=True)
PAGED16 = KernelTerm(VATTENTION_VS_VLLM, "paged", 16)
CONTIGUOUS = KernelTerm(VATTENTION_VS_VLLM, "contiguous")


def step(*items: tuple[int, int]) -> SimpleNamespace:
    """A scheduler output of (start, num_tokens) items, each sampling a token."""
    seq = SimpleNamespace(seq_id=0)
    return SimpleNamespace(items=[SimpleNamespace(start=s, num_tokens=n, needs_logits=True, seq=seq)
                                  for s, n in items])


def attention(kernel: KernelTerm | None, *items: tuple[int, int]) -> float:
    runner = RooflineRunner(COST, kernel=kernel)
    runner.execute(step(*items))
    return runner.attention_seconds


# -- none is today's model -----------------------------------------------------------------------------------------
def test_none_charges_exactly_the_roofline_step():
    out = step((999, 1), (4095, 1), (0, 300))
    runner = RooflineRunner(COST, kernel=None)
    runner.execute(out)
    assert runner.clock() == COST.step_seconds(1000 + 4096 + 300, 300, 0)
    assert runner.attention_seconds == COST.kv_read_seconds(1000 + 4096 + 300)
    assert kernel_profile("none") is None


def test_none_is_the_default_and_published_leaves_contiguous_decode_at_the_roofline():
    """Without prefill, a contiguous backend's steps under `vattention-vs-vllm` are the roofline's, to rounding."""
    workload = WorkloadSpec(num_requests=60, seed=0)
    case = SimCase("vmm", 6.0, page_size=2 * 2**20, watermark=0.05)
    default = run_case(case, SimSettings(workload=workload))
    explicit = run_case(case, SimSettings(workload=workload, kernel_costs="none"))
    published = run_case(case, SimSettings(workload=workload, kernel_costs="vattention-vs-vllm"))
    assert default.kernel_costs == "none" and default.sim_seconds == explicit.sim_seconds
    assert published.sim_seconds == pytest.approx(default.sim_seconds, rel=1e-9)
    assert published.num_steps == default.num_steps


# -- monotonicity and units ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", [PAGED16, CONTIGUOUS, KernelTerm(VATTENTION_VS_VLLM, "paged", 128)],
                         ids=["paged-16", "contiguous", "paged-128"])
def test_more_context_costs_more(kernel):
    for phase_items in (lambda c: [(c - 1, 1)], lambda c: [(c - 512, 512)]):
        times = [attention(kernel, *phase_items(c)) for c in (1024, 2048, 8192, 32768)]
        assert all(a < b for a, b in zip(times, times[1:])), times


def test_decode_attention_is_kv_bytes_over_bandwidth_times_the_ratio():
    bytes_per_token = 2 * 32 * 8 * 128 * 2                   # K and V, 32 layers, 8 KV heads, dim 128, bf16
    ideal = 4096 * bytes_per_token / 3.35e12                 # seconds on an H100's HBM
    assert attention(CONTIGUOUS, (4095, 1)) == pytest.approx(ideal, rel=1e-12)
    assert attention(PAGED16, (4095, 1)) == pytest.approx(1.97 * ideal, rel=1e-12)


def test_prefill_attention_is_compute_bound_at_the_mfu():
    flops = 4 * 1024 * (1024 + 1) / 2 * 32 * 128 * 32        # causal: 1024 queries over 1..1024 keys, 32 heads
    assert attention(CONTIGUOUS, (0, 1024)) == pytest.approx(flops / (989e12 * 0.5), rel=1e-12)


@pytest.mark.parametrize("items", [[(8191, 1)] * 4, [(0, 2048)], [(511, 1), (0, 300)]],
                         ids=["decode", "prefill", "mixed"])
def test_paged_at_block_16_costs_at_least_contiguous_under_published(items):
    assert attention(PAGED16, *items) >= attention(CONTIGUOUS, *items) > 0


def test_a_measured_ratio_is_interpolated_in_log_context_and_block_size():
    doc = {"format": "kvlab-kernel-profile/1", "points": [
        {"phase": "decode", "block_size": 16, "context": 1024, "ratio": 1.2},
        {"phase": "decode", "block_size": 16, "context": 4096, "ratio": 1.6},
        {"phase": "decode", "block_size": 64, "context": 1024, "ratio": 1.0},
        {"phase": "decode", "block_size": 64, "context": 4096, "ratio": 1.2},
        {"phase": "prefill", "block_size": 16, "context": 1024, "paged_s": 3.0, "contiguous_s": 2.0}]}
    prof = parse_profile(doc, "measured")
    assert prof.ratio("decode", 16, 2048) == pytest.approx(1.4)
    assert prof.ratio("decode", 32, 1024) == pytest.approx(1.1)
    assert prof.ratio("decode", 16, 100) == 1.2 and prof.ratio("decode", 256, 10**6) == 1.2
    assert prof.ratio("prefill", 16, 1024) == 1.5


# -- profiles from files -------------------------------------------------------------------------------------------
def test_a_cpu_profile_round_trips_through_its_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--kernels", "--contexts", "64,128", "--prefill-contexts", "32",
                 "--block-sizes", "16,32", "--batch", "2", "--repeats", "1"]) == 0
    doc = json.loads((tmp_path / "results" / "calibrate" / "kernels.json").read_text())
    assert len(doc["points"]) == 6 and doc["shape"]["num_heads"] == 32
    prof = kernel_profile("cpu")
    for p in doc["points"]:
        assert p["paged_s"] > 0 and p["contiguous_s"] > 0
        assert prof.ratio(p["phase"], p["block_size"], p["context"]) == pytest.approx(p["paged_s"] / p["contiguous_s"])
    again = parse_profile(json.loads(json.dumps(prof.to_json())), "cpu")
    assert again.points == prof.points
    row = run_case(SimCase("paged", 6.0, block_size=16, watermark=0.05),
                   SimSettings(workload=WorkloadSpec(num_requests=30, seed=0), kernel_costs="cpu"))
    assert row.kernel_costs == "cpu" and 0 < row.attention_share < 1


def test_the_gpu_checks_dry_run_profile_is_read_from_gpu_check_json(tmp_path):
    from kvlab.experiments.gpu.parts_kernels import part_kernel_costs
    result = part_kernel_costs(True)
    check = tmp_path / "gpu_check.json"
    check.write_text(json.dumps({"mode": "cpu-dry-run", "parts": {"kernel_costs": {"ok": True, "result": result}}}))
    prof = kernel_profile(f"measured:{check}")
    assert prof.name == "measured" and {p.phase for p in prof.points} == {"decode", "prefill"}
    check.write_text(json.dumps({"mode": "gpu", "parts": {"kernel_costs": {"ok": False, "error": "x"}}}))
    with pytest.raises(ConfigError, match="without a successful kernel_costs part"):
        kernel_profile(f"measured:{check}")


BAD_PROFILES = {
    "missing": (None, "no kernel profile at"),
    "not-json": ("{", "is not JSON"),
    "no-format": ({"points": []}, "not a kernel profile"),
    "no-points": ({"format": "kvlab-kernel-profile/1", "points": []}, "no points"),
    "no-prefill": ({"format": "kvlab-kernel-profile/1", "points": [
        {"phase": "decode", "block_size": 16, "context": 64, "ratio": 1.1}]}, "no prefill points"),
    "bad-phase": ({"format": "kvlab-kernel-profile/1", "points": [
        {"phase": "append", "block_size": 16, "context": 64, "ratio": 1.1}]}, "point phase"),
    "zero-ratio": ({"format": "kvlab-kernel-profile/1", "points": [
        {"phase": "decode", "block_size": 16, "context": 64, "ratio": 0}]}, "ratio must be a positive number"),
    "nan-time": ({"format": "kvlab-kernel-profile/1", "points": [
        {"phase": "decode", "block_size": 16, "context": 64, "paged_s": float("nan"), "contiguous_s": 1.0}]},
        "paged_s must be a positive number"),
}


@pytest.mark.parametrize("name", list(BAD_PROFILES))
def test_a_bad_profile_is_one_line_and_exit_2(name, tmp_path, capsys):
    content, phrase = BAD_PROFILES[name]
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError, match=phrase):
        read_profile(path, "measured", "hint")
    for argv in (["simulate", "--policies", "paged", "--num-requests", "10", "--no-save"],
                 ["simulate", "serve", "--backends", "paged-16", "--num-prompts", "10", "--no-save"]):
        assert main([*argv, "--kernel-costs", f"measured:{path}"]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and phrase in err[0] and "Traceback" not in err[0], err


def test_an_unknown_profile_name_is_refused():
    with pytest.raises(ConfigError, match="unknown --kernel-costs 'fast'; choose none \\| central"):
        kernel_profile("fast")


def test_each_published_profile_holds_its_sources_figures():
    """docs/evidence.md: the figures as the sources give them, on the axes they give."""
    central = kernel_profile("central")
    assert central.ratio("decode", 16, 512) == central.ratio("decode", 16, 32768) == pytest.approx(1.23)
    assert central.ratio("decode", 256, 4096) == 1.0 and central.ratio("prefill", 1024, 4096) == 1.0
    assert central.ratio("decode", 64, 4096) == pytest.approx(1.115)          # halfway in log2(block size)
    fa2 = kernel_profile("fa2-same-kernel")                                    # flash-attention#841, batch 32
    assert fa2.ratio("decode", 256, 1024) == pytest.approx(1 / 1.0756, rel=1e-3)
    assert fa2.ratio("decode", 256, 8192) == pytest.approx(1 / 1.3463, rel=1e-3)
    fa4 = kernel_profile("fa4-blocks")                                         # PR #1999: 9.906 / 6.345 / 2.147 ms
    assert fa4.ratio("decode", 1, 131072) == pytest.approx(4.614, rel=1e-3) and fa4.ratio("decode", 128, 1) == 1.0
    assert kernel_profile("vllm-vs-ft").ratio("decode", 16, 4096) == pytest.approx(1.23)
    cross = kernel_profile("vattention-vs-vllm")
    assert (cross.ratio("decode", 16, 4096), cross.ratio("prefill", 128, 4096)) == (1.97, 1.45)
    assert "cross-implementation" in cross.source and "docs/evidence.md" in central.source


def test_old_names_warn_and_resolve():
    from kvlab.experiments.sim.serve.costs import profile
    with pytest.warns(FutureWarning, match="vattention-vs-vllm"):
        assert kernel_profile("published") is kernel_profile("vattention-vs-vllm")
    with pytest.warns(FutureWarning, match="A100 figures"):
        assert profile("cuda-h200") is profile("cuda-a100")


# -- where step time goes ------------------------------------------------------------------------------------------
def test_rows_split_step_time_into_attention_driver_and_the_rest():
    case = SimCase("vmm", 6.0, page_size=2 * 2**20, watermark=0.05)
    spec = ServeSpec(num_requests=60, driver_profile="cuda-a100", kernel_costs="vattention-vs-vllm",
                     model_prefill=True, background_mapping=False)      # no overlap: driver time lengthens steps
    r = run_point(case, spec, 8.0, 0)
    sim = r["sim"]
    assert sim["attention_share"] + sim["driver_share"] + sim["other_share"] == pytest.approx(1.0)
    assert 0 < r["attention_share"] < 1 and 0 < r["driver_share"] < 1 and r["other_share"] > 0
    assert sim["driver_step_seconds"] == pytest.approx(r["driver"]["driver_exposed_seconds"])
    assert sim["busy_seconds"] <= sim["sim_seconds"] + 1e-9
    paged = run_point(SimCase("paged", 6.0, block_size=16, watermark=0.05), spec, 8.0, 0)
    assert paged["driver_share"] > 0 and paged["attention_share"] > 0      # the block-table uploads
