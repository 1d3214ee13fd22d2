"""Decode attention, one layer, batch 16: the vmm cache's contiguous views vs the paged cache's gather path.

Both sides are the real backends on the tiny model's head shape (4 query heads, 2 KV heads, dim 64, fp32):
a VMMKVCache whose K/V tensors are host-VM views (memfd pages mapped into a reserved range, 64 KiB pages) and
a PagedKVCache with 16-token blocks. The same logical K/V is written into both (their outputs must agree), and
each step is timed through `cache.attention`: write this step's K/V, then the dispatched kernel (the per-step
`prepare` is not included), so the numbers are what one model layer pays. "uniform": every sequence at the same
context; "mixed": contexts spread over [c/2, c], where the vmm kernel cannot batch sequences of different
lengths. The Triton paged kernel runs under the interpreter on a tiny shape only (about 5 ms per program step
here): a correctness check, not a speed.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from kvlab.common.attention.metadata import AttentionMetadata, BatchItem
from kvlab.common.config import make_config
from kvlab.common.kv.seam import KVCache, create_cache
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.experiments.bench.perf.harness import (
    Goal,
    Result,
    Settings,
    Timing,
    interleaved,
    paired_ratios,
    ratio,
    timing_detail,
)

FAMILY = "attention"
GOAL = Goal(">=", 1.5)
SHAPE = KVShape(num_layers=1, num_kv_heads=2, head_dim=64, num_q_heads=4)
BLOCK_SIZE = 16
PAGE_SIZE = 64 * 1024
SAMPLE_SECONDS = 0.02        # each timed sample repeats the call until it lasts about this long
MICRO_REPEATS = 3            # samples are short: take 3x --repeats of them, so one preemption moves no median


@dataclass(frozen=True, slots=True)
class Case:
    batch: int
    context: int
    spread: str              # "uniform" | "mixed"

    def contexts(self) -> list[int]:
        if self.spread == "uniform":
            return [self.context] * self.batch
        low = self.context // 2
        return [low + (self.context - low) * (i + 1) // self.batch for i in range(self.batch)]


def cases_for(settings: Settings) -> list[Case]:
    contexts, batch = ((64, 128), 4) if settings.quick else ((512, 1024, 2048, 4096, 8192), 16)
    return [Case(batch, c, spread) for c in contexts for spread in ("uniform", "mixed")]


def make_cache(backend: str, case: Case, kernel: str = "auto") -> KVCache:
    per_seq = -(-case.context // 1024) * 1024 * SHAPE.bytes_per_token
    config = make_config(backend=backend, block_size=BLOCK_SIZE, page_size=PAGE_SIZE, max_num_seqs=case.batch,
                          max_model_len=max(case.context, 1024), kv_cache_bytes=case.batch * per_seq + 2**22,
                          max_num_batched_tokens=max(2048, case.batch), kernel=kernel)
    return create_cache(config, SHAPE)


def logical_kv(case: Case, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dims = (SHAPE.num_kv_heads, SHAPE.head_dim)
    return [(torch.randn(c, *dims, generator=g), torch.randn(c, *dims, generator=g)) for c in case.contexts()]


def fill(cache: KVCache, case: Case, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[BatchItem]:
    """Allocate every sequence to its context and write its K/V at positions [0, context); -> decode items."""
    items = []
    for i, (ctx, (k, v)) in enumerate(zip(case.contexts(), kv)):
        seq = Sequence(i, str(i), [1] * ctx, 1)
        cache.allocator.allocate(seq, ctx)
        seq.num_computed_tokens = ctx - 1
        write_context(cache, seq, k, v)
        items.append(BatchItem(seq, ctx - 1, 1))
    return items


def write_context(cache: KVCache, seq: Sequence, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K/V at positions [0, len) where the cache's own prefill metadata says they go."""
    meta = cache.storage.prepare([BatchItem(seq, 0, k.shape[0])])
    if cache.name == "vmm":
        slot = int(meta.slots[0])
        cache.storage.k_caches[0][slot, :k.shape[0]].copy_(k)
        cache.storage.v_caches[0][slot, :v.shape[0]].copy_(v)
    else:
        cache.storage.k_caches[0].view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
        cache.storage.v_caches[0].view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)


@dataclass(slots=True)
class Bench:
    """One backend's decode step, ready to time: the real cache, its metadata, this step's q/k/v."""
    cache: KVCache
    items: list[BatchItem]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata

    def step(self) -> torch.Tensor:
        return self.cache.storage.attention(0, self.q, self.k, self.v, self.meta, SHAPE.head_dim ** -0.5)


def make_bench(backend: str, case: Case, seed: int, kernel: str = "auto") -> Bench:
    cache = make_cache(backend, case, kernel)
    items = fill(cache, case, logical_kv(case, seed))
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(case.batch, SHAPE.num_q_heads, SHAPE.head_dim, generator=g)
    k = torch.randn(case.batch, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
    v = torch.randn(case.batch, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
    return Bench(cache, items, q, k, v, cache.storage.prepare(items))


def timed(fn, inner: int):
    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner
    return sample


def calls_per_sample(fn) -> int:
    fn()   # warm-up (scratch buffers, first-touch of pages)
    t0 = time.perf_counter()
    fn()
    return max(1, int(SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-6)))


def compare_case(case: Case, settings: Settings) -> list[Result]:
    benches = {backend: make_bench(backend, case, settings.seed) for backend in ("vmm", "paged")}
    try:
        outs = {name: b.step() for name, b in benches.items()}
        err = float((outs["vmm"] - outs["paged"]).abs().max())
        if err > 1e-4:
            raise AssertionError(f"vmm and paged decode attention disagree by {err:.2e} at {case}")
        kernels = {name: b.cache.kernel_report()["kernels"]["decode"] for name, b in benches.items()}
        timings = interleaved({name: timed(b.step, calls_per_sample(b.step)) for name, b in benches.items()},
                              MICRO_REPEATS * settings.repeats)
    finally:
        for b in benches.values():
            b.cache.close()
    return rows_for(case, timings, kernels, err)


def rows_for(case: Case, timings: dict[str, Timing], kernels: dict[str, str], err: float) -> list[Result]:
    label = f"ctx {case.context} {case.spread}, batch {case.batch}"
    rows = [Result(FAMILY, f"{name} ({kernels[name]}) {label}", timings[name].median * 1e3, "ms",
                   detail={**timing_detail(timings[name]), "contexts": case.contexts()}) for name in timings]
    rows.append(Result(FAMILY, f"paged gather / vmm views, {label}",
                       ratio(timings["paged"].median, timings["vmm"].median), "x", GOAL,
                       note="decode step time, one layer",
                       detail={"max_abs_diff": err, **paired_ratios(timings["paged"], timings["vmm"])}))
    return rows


def triton_rows(settings: Settings) -> list[Result]:
    """The Triton kernel beside the gather path on a tiny CPU shape, in the interpreter (the compiled kernel is
    measured on a GPU by experiments/gpu_check.sh)."""
    name = "triton_paged vs torch_paged, ctx 64, batch 2 (interpreter: correctness only)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return [Result(FAMILY, name, None, "ms", note="skipped: TRITON_INTERPRET is not 1 (set when no GPU)")]
    case = Case(2, 64, "mixed")
    triton = make_bench("paged", case, settings.seed, kernel="triton_paged")
    gather = make_bench("paged", case, settings.seed, kernel="torch_paged")
    try:
        err = float((triton.step() - gather.step()).abs().max())
        timings = interleaved({"triton": timed(triton.step, 1), "torch": timed(gather.step, 1)},
                              min(settings.repeats, 3))
        report = triton.cache.kernel_report()
    finally:
        triton.cache.close()
        gather.cache.close()
    if report["runtime_fallbacks"] or report["kernels"]["decode"] != "triton_paged":
        raise AssertionError(f"the Triton kernel did not run: {report}")
    return [Result(FAMILY, name, timings["triton"].median * 1e3, "ms",
                   note=f"max |diff| {err:.1e}; torch_paged {timings['torch'].median * 1e3:.2f} ms",
                   detail={"max_abs_diff": err, "triton": timing_detail(timings["triton"]),
                           "torch_paged": timing_detail(timings["torch"])})]


def run(settings: Settings) -> list[Result]:
    rows = []
    for case in cases_for(settings):
        rows += compare_case(case, settings)
    return rows + triton_rows(settings)
