"""The kernel term's measurement (`kvlab calibrate --kernels`, and the GPU check's kernel_costs part): one
layer's attention on the contiguous layout (SDPA over [batch, heads, context, dim], what a vmm slot gives a
kernel) against kvlab's paged path (torch_paged: gather the blocks through the block table, then SDPA), on the
same K/V, across phases, context lengths and block sizes. The inputs are the perf suite's
(bench/perf/kernel_inputs.py: shuffled block ids, so a kernel that ignored the table would fail). Writes a
kernel profile (experiments/sim/kernels.py) whose ratios are paged time / contiguous time."""
from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

from kvlab.experiments.sim.kernels import FORMAT


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure: a head shape and dtype, and the points of the profile."""
    num_heads: int = 32              # Llama-3-8B, one layer of one rank
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float32"
    batch: int = 8
    decode_contexts: tuple[int, ...] = (512, 2048, 8192)
    prefill_contexts: tuple[int, ...] = (256, 1024)
    block_sizes: tuple[int, ...] = (16, 32, 128)
    repeats: int = 5


def measure_profile(grid: Grid, device: str, name: str, source: str) -> dict[str, Any]:
    """The kernel profile document: every (phase, block size, context) point of the grid, timed on `device`."""
    points = [measure_point(grid, device, phase, block, ctx)
              for phase, contexts in (("decode", grid.decode_contexts), ("prefill", grid.prefill_contexts))
              for ctx in contexts for block in grid.block_sizes]
    shape = {k: getattr(grid, k) for k in ("num_heads", "num_kv_heads", "head_dim", "dtype", "batch", "repeats")}
    return {"format": FORMAT, "name": name, "source": source, "device": device, "machine": platform.platform(),
            "paged_kernel": "torch_paged (gather + SDPA)", "contiguous_kernel": "SDPA", "shape": shape,
            "points": points}


def measure_point(grid: Grid, device: str, phase: str, block_size: int, context: int) -> dict[str, Any]:
    import torch

    from kvlab.experiments.bench.perf.kernel_inputs import paged_case
    from kvlab.paged.kernels.torch_ref import paged_attention_torch
    queries = 1 if phase == "decode" else context
    case = paged_case([queries] * grid.batch, [context] * grid.batch, block_size, grid.num_heads,
                      grid.num_kv_heads, grid.head_dim, getattr(torch, grid.dtype), device)
    contiguous = contiguous_call(case, grid.batch, queries)
    paged = lambda: paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)  # noqa: E731
    check_agree(contiguous(), paged(), grid.dtype, phase)
    contiguous_s, paged_s = paired_medians(device, contiguous, paged, grid.repeats)
    return {"phase": phase, "block_size": block_size, "context": context, "batch": grid.batch,
            "contiguous_s": contiguous_s, "paged_s": paged_s, "ratio": paged_s / contiguous_s}


def paired_medians(device: str, first: Any, second: Any, repeats: int) -> tuple[float, float]:
    """Median seconds per call of each, their calls alternated so that load on a shared machine drifts into
    both alike (after one warm-up call each)."""
    import statistics

    from kvlab.experiments.gpu.timing import one_call_seconds
    first(), second()
    pairs = [(one_call_seconds(device, first), one_call_seconds(device, second)) for _ in range(repeats)]
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def contiguous_call(case: Any, batch: int, queries: int) -> Any:
    """SDPA over the same K/V laid out densely per sequence: [B, H_kv, context, D], causal for a prefill."""
    import torch
    import torch.nn.functional as F

    from kvlab.experiments.bench.perf.kernel_inputs import sequence_kv
    ks, vs = zip(*(sequence_kv(case, b) for b in range(batch)))
    k = torch.stack(ks).transpose(1, 2).contiguous()
    v = torch.stack(vs).transpose(1, 2).contiguous()
    q = case.q.view(batch, queries, *case.q.shape[1:]).transpose(1, 2).contiguous()
    causal = queries > 1
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=case.scale, is_causal=causal, enable_gqa=True)


def check_agree(contiguous: Any, paged: Any, dtype: str, phase: str) -> None:
    """Both layouts must compute the same attention, or the timing compares different work."""
    flat = contiguous.transpose(1, 2).reshape(paged.shape)
    err = float((flat.float() - paged.float()).abs().max())
    if err > (1e-4 if dtype == "float32" else 2e-2):
        raise AssertionError(f"contiguous and paged {phase} attention disagree by {err:.2e}")
