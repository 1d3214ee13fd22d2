"""Smoke tests of the performance suite and the GPU check's CPU dry run: every benchmark runs at its smallest
size and reports well-formed rows; nothing here asserts a speed (speed goals live in the benchmarks)."""
from __future__ import annotations

import importlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.common.attention.metadata import BatchItem, base_metadata
from kvlab.common.sequence import Sequence
from kvlab.experiments.bench.perf.__main__ import FAMILIES, main
from kvlab.experiments.bench.perf.harness import Goal, Result, Settings, Timing, interleaved, measure
from kvlab.experiments.sim.kernels import kernel_profile
from kvlab.experiments.sim.serve.costs import profile as driver_profile

ROOT = Path(__file__).resolve().parent.parent
QUICK = Settings(threads=1, repeats=1, quick=True)


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.py


def check_rows(rows: list[Result], family: str) -> None:
    assert rows and all(isinstance(r, Result) and r.family == family for r in rows)
    for r in rows:
        assert r.name and r.unit
        if r.value is None:
            assert "skipped" in r.note, f"{r.name}: no value and no reason"
        else:
            assert math.isfinite(r.value) and r.value >= 0, f"{r.name}: {r.value}"
        json.dumps(r.to_dict(), default=str)


# -- the harness -------------------------------------------------------------------------------------------------
def test_timing_and_goals():
    t = Timing.of([3.0, 1.0, 2.0, 10.0])
    assert t.median == 2.5 and t.repeats == 4 and 3.0 < t.p90 <= 10.0
    assert Goal(">=", 3).met(3.0) and not Goal(">=", 3).met(2.9) and Goal("<", 1).met(0.5)
    assert Goal("<=", 3).met(None) is None and str(Goal(">=", 1.5)) == ">= 1.5"
    row = Result("f", "ratio", 0.5, "x", Goal(">=", 1.0))
    assert row.met is False and row.to_dict()["goal"] == ">= 1" and row.to_dict()["met"] is False


def test_measure_and_interleaved_count_calls():
    calls = []
    t = measure(lambda: calls.append(1), repeats=3, warmup=2, inner=4)
    assert len(calls) == 2 + 3 * 4 and t.repeats == 3
    order = []
    timings = interleaved({"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or 2.0}, 3)
    assert order == ["a", "b"] * 3 and timings["a"].median == 1.0 and timings["b"].median == 2.0


# -- each family at its smallest size ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "serving" else f   # ~8 s: real
                                    for f in FAMILIES])                         # servers, as test_serve_bench.py
def test_family_runs_and_reports_rows(family):
    rows = importlib.import_module(FAMILIES[family]).run(QUICK)
    check_rows(rows, family)
    if family == "roofline":
        check_roofline(rows)
    goals = [r for r in rows if r.goal is not None]
    expected_goals = {"throughput": 2, "attention": 4, "end_to_end": 1, "allocator": 2, "simulator": 3,
                      "serving": 1, "roofline": 0, "hf_cb": 0}
    assert len(goals) == expected_goals[family]


def test_the_roofline_share_is_the_median_of_rounds_that_time_both_halves(monkeypatch):
    """Each round times the limit, then the rate, at that round's machine speed: a round at half speed halves
    both, and the share (decode at half the limit) stays 0.5."""
    from kvlab.experiments.bench.perf import roofline
    speed = iter([1.0, 2.0, 1.0])                       # the round's slowdown
    step_seconds, slow = [], [1.0]

    def fake_measure(fn, repeats, warmup=1, inner=1):
        if warmup == 0:                                 # a round's timed limit: 0.01 s a step at full speed
            slow[0] = next(speed)
            step_seconds.append(0.01 * slow[0])
            return Timing.of([step_seconds[-1]])
        return Timing.of([0.01])
    monkeypatch.setattr(roofline, "measure", fake_measure)
    monkeypatch.setattr(roofline, "matmul_step", lambda model, batch: lambda: None)
    # decode at half the limit: (long - short) tokens take twice a step's matmul time per token
    monkeypatch.setattr(roofline, "generate_seconds", lambda llm, batch: lambda n: 0.02 * n * slow[0])
    share, rate, limit = roofline.paired_share(None, None, batch=4, short=8, long=40, repeats=3)
    assert share == pytest.approx(0.5) and rate == pytest.approx(200.0) and limit == pytest.approx(400.0)
    assert step_seconds == [0.01, 0.02, 0.01]


def test_the_step_split_counts_extra_steps_only_and_its_parts_sum_to_the_step(monkeypatch):
    """A fake LLM whose generate(n) runs n steps, each 1 ms in matmuls, 0.5 in attention and 0.25 elsewhere in the
    forward, 0.25 outside it, plus a fixed 10 ms: the split of one step is exactly that; the wrappers come off."""
    from types import SimpleNamespace

    from kvlab.common.model import Linear
    from kvlab.experiments.bench.perf.step_split import decode_split
    clock = [0.0]
    monkeypatch.setattr("time.perf_counter", lambda: clock[0])

    def spend(ms):
        clock[0] += ms / 1e3

    class Storage:
        def attention(self):
            spend(0.5)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear(2, 2)
            self.proj.gemm = lambda x, w: spend(1.0)

        def forward(self):
            self.proj(None)
            storage.attention()
            spend(0.25)

    storage, model = Storage(), Model()
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(model=model, cache=storage)))
    gemm = model.proj.gemm

    def generate(n):
        start = clock[0]
        spend(10.0)
        for _ in range(n):
            model.forward()
            spend(0.25)
        return clock[0] - start
    split = decode_split(llm, generate, 8, 40)
    assert (split.step, split.matmul, split.attention, split.other_forward, split.engine) == pytest.approx(
        (2.0, 1.0, 0.5, 0.25, 0.25))
    assert model.proj.gemm is gemm and "attention" not in vars(storage) and "forward" not in vars(model)


def check_roofline(rows: list[Result]) -> None:
    """A row per backend, each splitting its decode step into parts that sum to it."""
    assert [r.detail["backend"] for r in rows] == ["paged", "vmm"]
    for r in rows:
        split = r.detail["step_split_ms"]
        assert split["step"] > 0 and split["matmul"] > 0 and split["attention"] > 0
        assert sum(split[k] for k in ("matmul", "attention", "other_forward", "engine")) == pytest.approx(
            split["step"])


@pytest.mark.triton_cpu
def test_attention_rows_cover_both_layouts_and_the_triton_kernel():
    from kvlab.experiments.bench.perf import attention
    rows = attention.run(QUICK)
    names = [r.name for r in rows]
    assert any(n.startswith("vmm (torch_sdpa_contiguous)") for n in names)
    assert any(n.startswith("paged (torch_paged)") for n in names)
    triton = next(r for r in rows if r.name.startswith("triton_paged"))
    assert triton.value is not None and triton.detail["max_abs_diff"] < 1e-4   # conftest: TRITON_INTERPRET=1


def test_hf_baseline_holds_the_same_weights_and_counts_waste():
    from kvlab.common.presets import load_tiny
    from kvlab.experiments.bench.perf.hf_baseline import check_parity, static_batches, to_hf
    model, _ = load_tiny("float32", "cpu", 0)
    hf = to_hf(model)
    assert check_parity(model, hf) < 1e-4
    run = static_batches(hf, [[5, 6, 7], [8, 9]], [2, 5], batch_size=2)
    assert (run.useful_tokens, run.generated_tokens, run.batches) == (7, 10, 1)


def test_main_writes_json_and_reports_a_failing_family(tmp_path, monkeypatch, capsys):
    from kvlab.experiments.bench.perf import simulator
    out = tmp_path / "perf.json"
    assert main(["--quick", "--repeats", "1", "--only", "simulator", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["threads"] == 1 and doc["machine"]["torch_threads"] == 1
    assert {r["family"] for r in doc["results"]} == {"simulator"} and doc["errors"] == {}
    assert all(r["goal"] is None for r in doc["results"])        # quick sizes are not held to goals

    def broken(settings):
        raise RuntimeError("boom")
    monkeypatch.setattr(simulator, "run", broken)
    assert main(["--quick", "--only", "simulator", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["errors"] == {"simulator": "RuntimeError: boom"}
    assert "simulator" in capsys.readouterr().err


def test_main_rejects_unknown_families():
    with pytest.raises(SystemExit):
        main(["--only", "nonsense"])


# -- the vectorised base_metadata keeps the per-token reference's results ----------------------------------------
def reference_base_metadata(items: list[BatchItem]) -> dict:
    query = [it.num_tokens for it in items]
    cu = [0]
    for n in query:
        cu.append(cu[-1] + n)
    return {"input_positions": [p for it in items for p in range(it.start, it.context_len)], "query_lens": query,
            "context_lens": [it.context_len for it in items], "cu_query_lens": cu,
            "max_query_len": max(query, default=0),
            "max_context_len": max((it.context_len for it in items), default=0),
            "logits_indices": [cu[i + 1] - 1 for i, it in enumerate(items) if it.needs_logits]}


def test_base_metadata_matches_the_per_token_reference():
    rng = random.Random(0)
    for case in range(300):
        items = []
        for i in range(rng.randint(0, 6)):
            start, n = rng.randint(0, 40), rng.choice([0, 1, 1, 1, rng.randint(1, 30)])
            items.append(BatchItem(Sequence(i, str(i), [1] * (start + n + 1), 1), start, n, rng.random() < 0.7))
        got, want = base_metadata(items), reference_base_metadata(items)
        for key, value in want.items():
            if isinstance(got[key], torch.Tensor):
                expected_dtype = torch.int64 if key in ("input_positions", "logits_indices") else torch.int32
                assert got[key].dtype == expected_dtype, key
                assert got[key].tolist() == value, (case, key)
            else:
                assert got[key] == value, (case, key)


# -- the GPU check, dry run on this CPU --------------------------------------------------------------------------
# Slow: every part in its own process, ~50 CPU s. The default suite keeps the same script, dry-run mode and part
# runner in test_gpu_check.py's first-contact dry run, and the check-only parts' code in their own tests
# (test_kernel_costs.py, test_pool_cuda.py, test_vmm_cuda.py, test_gpu.py's skips).
@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_part_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh"), "--dry-run-cpu", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420, check=False)
    doc = json.loads(out.read_text())
    parts = doc["parts"]
    assert proc.returncode == 0, {k: v.get("error") for k, v in parts.items()}
    assert doc["mode"] == "cpu-dry-run" and doc["selection"] == "check"
    assert list(parts) == ["environment", "cuda_vmm", "vmm_sizes", "kernel_costs", "background_map", "layer_layout",
                           "handoff_copy", "vmm_vs_paged", "elastic_cuda", "gpu_tests", "cuda_pool",
                           "cuda_pool_engines", "unmapped_access"]
    profile = parts["kernel_costs"]["result"]["profile"]
    assert {p["phase"] for p in profile["points"]} == {"decode", "prefill"} and profile["name"] == "measured"
    assert profile["paged_kernel"].startswith("triton_paged") and profile["contiguous_kernel"].startswith("triton")
    rows = parts["kernel_costs"]["result"]["rows"]
    assert {r["block_size"] for r in rows} == {16, 32} and all(r["max_abs_diff"] <= 1e-4 for r in rows)
    # the check's JSON is what both simulator terms read as measured:FILE
    assert kernel_profile(f"measured:{out}").ratio("decode", 16, 32) == next(
        r["ratio"] for r in rows if (r["phase"], r["block_size"]) == ("decode", 16))
    figures = parts["vmm_sizes"]["result"]["driver_figures"]["points"]
    assert driver_profile(f"measured:{out}", None, 4 * 2**20).map_s == figures[1]["map_s"]
    sizes = parts["vmm_sizes"]["result"]
    assert [r["pages"] for r in sizes["sizes"]] == [1, 2, 4] and sizes["fake_leaks"] == {}
    assert all("unmap_per_run_us" in r["page_handles"] for r in sizes["sizes"])
    background = parts["background_map"]["result"]
    assert background["mapper"]["pages_mapped"] > 0 and background["fake_leaks"] == {}
    assert {"alone", "while_mapping", "alone_after"} <= set(background)
    layout = parts["layer_layout"]["result"]["rows"]
    assert len(layout) == 1 and layout[0]["cross_over_per_layer"] > 0
    handoff = parts["handoff_copy"]["result"]
    assert [r["pages"] for r in handoff["rows"]] == [1, 2] and handoff["fake_leaks"] == {}
    assert all(r["copy"]["scattered_per_block_copy_ms"] > 0 and r["remap"]["per_page_us"] > 0
               for r in handoff["rows"])
    vmm = parts["cuda_vmm"]["result"]
    assert vmm["driver"].startswith("recording fake") and vmm["minimum_granularity"] == 2 * 2**20
    assert set(vmm["latency"]["us"]) == {"create", "map", "set_access", "unmap", "release"}
    assert vmm["fake_leaks"] == {} and "view_error" in vmm["round_trip"]      # a CPU torch cannot wrap it
    # the Triton-vs-reference error on the same dry cases: test_gpu_check's first-contact dry run (triton_kernel)
    bench = parts["vmm_vs_paged"]["result"]
    assert bench["backends"]["paged"]["kernels"]["decode"] == "torch_paged"
    assert bench["identical_outputs"] == bench["workload"]["requests"]
    elastic = parts["elastic_cuda"]["result"]
    assert elastic["block_pool"]["fake_leaks"] == {} and elastic["block_pool"]["steps"][-1]["mapped_pages"] == 0
    assert elastic["tiny_model"]["identical_outputs"] == elastic["tiny_model"]["requests"]
    assert elastic["tiny_model"]["elastic"]["kernels"]["decode"] == "torch_paged"
    tests = parts["gpu_tests"]["result"]
    assert tests["files"] == ["tests/test_gpu.py"] and tests["counts"].get("skipped", 0) > 0
    assert tests["counts"].get("failed", 0) == 0 and parts["unmapped_access"]["result"]["ran"] is False


@pytest.mark.slow
def test_hf_continuous_batching_rows_on_smollm2():
    from kvlab.experiments.bench.perf import hf_cb
    rows = hf_cb.measure(Settings(repeats=2), num_requests=6, scale=1 / 64)
    if rows[0].value is None:
        pytest.skip(rows[0].note)
    check_rows(rows, "hf_cb")
    last = rows[-1]
    assert last.goal is not None and last.value > 0 and last.detail["greedy_outputs_equal"] >= 1
    same_gemm = rows[-2]                   # vmm on HF's own GEMM: the engine's margin alone
    assert "F.linear" in same_gemm.name and same_gemm.goal is None and same_gemm.value > 0


def test_engine_loop_overhead_runs_both_loops_to_the_end():
    """The served engine loop and the bare step loop each finish every request, repeat after repeat, on one
    engine (the loop leaves it open), and the share is computed from the pairs."""
    from kvlab.experiments.bench import engine_loop_overhead, serving_overhead
    d = engine_loop_overhead.measure("paged", repeats=2, reqs=serving_overhead.workload(4, 8, 8))
    assert len(d["bare_cpu_s"]) == len(d["loop_cpu_s"]) == 2
    assert all(x > 0 for x in d["bare_cpu_s"] + d["loop_cpu_s"]) and math.isfinite(d["loop_extra_cpu_share"])


def test_the_served_run_ignores_eos_as_the_offline_run_does(monkeypatch):
    """Both runs must make every request's output_len tokens: a served request stopping at EOS would make the
    served run shorter, not faster (the offline run passes ignore_eos; 256 x 128 tokens showed 123 fewer)."""
    from kvlab.experiments.bench import serving_overhead
    from kvlab.experiments.loadgen.latency import RequestRecord
    seen = []

    async def fake_load(target, reqs, arrivals):
        seen.append(target)
        return [RequestRecord(prompt_len=r.prompt_len, output_tokens=r.output_len, success=True) for r in reqs], 1.0, 1
    monkeypatch.setattr(serving_overhead, "run_load", fake_load)
    reqs, tokens = serving_overhead.workload(2, 4, 3), []
    assert serving_overhead.served_run("http://127.0.0.1:1", reqs, tokens)() == 1.0
    assert seen[0].ignore_eos and seen[0].base_url == "http://127.0.0.1:1" and tokens == [6]
