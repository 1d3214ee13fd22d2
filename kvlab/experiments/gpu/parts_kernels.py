"""The GPU check's kernel_costs part: the paged/contiguous ratio within ONE kernel family, kvlab's Triton
kernel on both layouts of the same K/V (experiments/gpu/kernel_cases.py), at Llama-3-8B's per-rank shape (32
query heads, 8 KV heads, d = 128, bf16). Decode over a subsample of batch 1-256 x context 512-32K x block
16/32/128/256, and a few prefill points. Kernel time is GPU time of CUDA-graph replays (GraphTimer), the two
layouts alternated. Its result holds, besides every (batch, context, block) row, the kernel profile that
`kvlab simulate --kernel-costs measured:gpu_check.json` reads (sim/kernels.py): one point per (phase, block,
context), the median ratio over the batches measured there. The CPU dry run: the interpreter, tiny shapes."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from kvlab.experiments.gpu import kernel_cases as kc
from kvlab.experiments.gpu.kernel_cases import LLAMA3_8B_BF16, TINY_FP32, Shape
from kvlab.experiments.gpu.timing import GraphTimer, paired_seconds, part_deadline
from kvlab.experiments.sim.kernels import FORMAT

AGREE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}   # paged vs contiguous: the same sums, reordered


@dataclass(frozen=True, slots=True)
class Plan:
    shape: Shape
    decode: tuple[tuple[int, int], ...]       # (batch, context), in the order measured
    prefill: tuple[tuple[int, int], ...]      # (batch, context): queries = context (a whole prompt)
    blocks: tuple[int, ...]
    row: int                                  # contiguous layout: tokens per slot row (>= every context)
    repeats: int
    inner: int


def gpu_plan() -> Plan:
    """Decode: every (batch, context) of {1, 8, 32, 128, 256} x {512, 2K, 8K, 32K} with at most 2M tokens (8 GiB
    of K/V per layout), smallest first; prefill: batch 4 at 512 and 2K, batch 1 at 8K."""
    decode = sorted(((b, c) for b in (1, 8, 32, 128, 256) for c in (512, 2048, 8192, 32768) if b * c <= 2**21),
                    key=lambda bc: (bc[0] * bc[1], bc[1]))
    return Plan(LLAMA3_8B_BF16, tuple(decode), ((4, 512), (4, 2048), (1, 8192)), (16, 32, 128, 256), 32768, 7, 8)


def dry_plan() -> Plan:
    return Plan(TINY_FP32, ((2, 32),), ((1, 32),), (16, 32), 32, 1, 1)


def part_kernel_costs(dry: bool) -> dict[str, Any]:
    import torch

    from kvlab.experiments.gpu.parts_triton import check_interpreter_setting
    check_interpreter_setting(dry)
    device, plan, deadline = ("cpu" if dry else "cuda"), (dry_plan() if dry else gpu_plan()), part_deadline()
    gpu = "cpu dry run" if dry else torch.cuda.get_device_name()
    rows: list[dict[str, Any]] = []
    skipped = []
    for phase, points in (("decode", plan.decode), ("prefill", plan.prefill)):
        for batch, context in points:
            if time.perf_counter() > deadline:
                skipped.append(f"{phase} batch {batch} context {context}")
                continue
            rows += measure_point(plan, device, phase, batch, context)
            if device == "cuda":
                torch.cuda.empty_cache()
    out = {"device": device, "gpu": gpu, "rows": rows, "profile": profile_of(rows, plan, gpu)}
    if skipped:
        out["not_measured_time_budget"] = skipped
    fallbacks = sorted({r["fallback"] for r in rows if r.get("fallback")})
    if fallbacks:
        out["fallbacks"] = fallbacks
    if not {r["phase"] for r in rows} >= {"decode", "prefill"}:
        out["failed"] = "no decode or no prefill point measured within the part's time budget"
    return out


def measure_point(plan: Plan, device: str, phase: str, batch: int, context: int) -> list[dict[str, Any]]:
    """Every block size at one (phase, batch, context): paged vs contiguous, both timed alternately."""
    queries = 1 if phase == "decode" else context
    x = kc.make_inputs(plan.shape, batch, context, queries, device, plan.row)
    contiguous = kc.contiguous_call(x, plan.row)
    reference = contiguous()
    b = GraphTimer(device, contiguous, plan.inner)
    rows = []
    for block in plan.blocks:
        paged = kc.paged_call(x, block)
        err = float((paged().float() - reference.float()).abs().max())
        if err > AGREE[plan.shape.dtype]:
            raise AssertionError(f"{phase} batch {batch} context {context} block {block}: paged and contiguous "
                                 f"outputs differ by {err:.2e}: the two calls do not compute the same attention")
        a = GraphTimer(device, paged, plan.inner)
        paged_s, contiguous_s = paired_seconds(a, b, plan.repeats)
        rows.append({"phase": phase, "batch": batch, "context": context, "block_size": block,
                     "paged_s": paged_s, "contiguous_s": contiguous_s, "ratio": paged_s / contiguous_s,
                     "max_abs_diff": err, "fallback": a.fallback or b.fallback})
    return rows


def profile_of(rows: list[dict[str, Any]], plan: Plan, gpu: str) -> dict[str, Any]:
    """The kernel profile (sim/kernels.py's format): per (phase, block, context) the median ratio over the
    batches measured there, with the times of the median batch."""
    keyed: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["phase"], r["block_size"], r["context"]), []).append(r)
    points = []
    for (phase, block, context), group in sorted(keyed.items()):
        ratios = [r["ratio"] for r in group]
        points.append({"phase": phase, "block_size": block, "context": context,
                       "ratio": statistics.median(ratios), "batches": [r["batch"] for r in group],
                       "ratio_by_batch": ratios})
    s = plan.shape
    return {"format": FORMAT, "name": "measured",
            "source": f"GPU check kernel_costs on {gpu}: kvlab's Triton kernel, paged vs the same kernel on the "
                      f"contiguous layout, {s.num_heads}/{s.num_kv_heads} heads, d={s.head_dim}, {s.dtype}; "
                      "each point the median over the batches measured",
            "paged_kernel": "triton_paged (block table, shuffled blocks)",
            "contiguous_kernel": "triton_paged with one block per sequence row (no scattered blocks)",
            "shape": {"num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
                      "dtype": s.dtype, "repeats": plan.repeats, "calls_per_timing": plan.inner},
            "points": points}
