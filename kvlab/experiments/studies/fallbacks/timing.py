"""`kvlab fallbacks --measure`: time, on this machine, the kernels that run here, so a fallback has a cost.

Two parts:
1. Kernel timings: every kernel the registry accepts on this device, over real caches built through the
   kernel contract (PagedMetadata / ContiguousMetadata from `base_metadata`), each output checked against
   dense causal attention. Triton on CPU runs in the interpreter (about 5 ms per program and loop step), so
   only on a tiny shape, beside torch_paged on the same shape.
2. Fallback costs: for each fallback path found for this machine, the chosen kernel against the displaced one at
   the nearest configuration it accepts (the refused block size / dtype / head dim moved), if it runs here.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from kvlab.common.attention.declarations import REGISTRY, KernelDecl
from kvlab.common.attention.dispatch import resolve
from kvlab.common.attention.metadata import BatchItem, ContiguousMetadata, PagedMetadata, base_metadata
from kvlab.common.attention.spec import AttentionSpec
from kvlab.common.kv.torch_dtypes import TORCH_DTYPES
from kvlab.common.sequence import Sequence
from kvlab.experiments.studies.fallbacks.grid import Grid, Row
from kvlab.experiments.studies.fallbacks.summary import fallback_paths

log = logging.getLogger("kvlab.fallbacks")

NUM_KV_HEADS = 2
GQA = 4
BLOCK_SIZE = 16
HEAD_DIMS = (64, 128)
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


@dataclass(frozen=True, slots=True)
class Shape:
    batch: int
    context: int      # tokens in the cache after this step, per sequence
    query: int        # new tokens per sequence (1 = decode)


SHAPES = {"decode": Shape(8, 512, 1), "prefill": Shape(2, 384, 128)}
TINY = {"decode": Shape(1, 40, 1), "prefill": Shape(1, 40, 8)}   # for kernels too slow here (interpreter)


@dataclass(slots=True)
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: Any
    scale: float
    expected: torch.Tensor   # dense causal attention in fp32


def machine() -> tuple[str, tuple[int, int] | None]:
    if torch.cuda.is_available():
        return "cuda", tuple(torch.cuda.get_device_capability())
    return "cpu", None


def spec_for(layout: str, device: str, cc: tuple[int, int] | None, dtype: str, head_dim: int,
             block_size: int | None = BLOCK_SIZE, gqa: int = GQA) -> AttentionSpec:
    return AttentionSpec(layout, device, dtype, head_dim, gqa * NUM_KV_HEADS, NUM_KV_HEADS,
                         block_size if layout == "paged" else None, cc)


# -- building a real step ------------------------------------------------------------------------------------
def build_case(spec: AttentionSpec, shape: Shape, seed: int = 0) -> Case:
    """Random K/V for `shape.batch` sequences of `shape.context` tokens, laid out as `spec.layout` needs, and
    queries for each sequence's last `shape.query` positions."""
    gen = torch.Generator().manual_seed(seed)
    dtype, device = TORCH_DTYPES[spec.dtype], spec.device
    b, ctx, n = shape.batch, shape.context, shape.query
    keys = torch.randn(b, ctx, spec.num_kv_heads, spec.head_dim, generator=gen)
    values = torch.randn(b, ctx, spec.num_kv_heads, spec.head_dim, generator=gen)
    q = torch.randn(b * n, spec.num_q_heads, spec.head_dim, generator=gen)
    items = [BatchItem(Sequence(i, f"r{i}", [0] * ctx, 1), ctx - n, n) for i in range(b)]
    base = base_metadata(items, device)
    if spec.layout == "paged":
        k_cache, v_cache, meta = _paged(keys, values, spec.block_size, base, gen)
    else:
        k_cache, v_cache, meta = _contiguous(keys, values, base, gen)
    scale = 1.0 / math.sqrt(spec.head_dim)
    # the reference sees the values as stored (rounded to the kernel's dtype)
    q, keys, values = (t.to(dtype) for t in (q, keys, values))
    expected = dense_attention(q.float(), keys.float(), values.float(), n, scale)
    k_cache, v_cache = (c.to(dtype).to(device) for c in (k_cache, v_cache))
    return Case(q.to(device), k_cache, v_cache, meta, scale, expected)


def _paged(keys, values, block_size, base, gen):
    b, ctx, h, d = keys.shape
    per_seq = -(-ctx // block_size)
    num_blocks = b * per_seq + 1                       # block 0 stays unused, like a table's padding entries
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(b, per_seq)
    k_cache = torch.zeros(num_blocks, block_size, h, d)
    v_cache = torch.zeros_like(k_cache)
    padded = per_seq * block_size
    for cache, src in ((k_cache, keys), (v_cache, values)):
        full = torch.zeros(b, padded, h, d)
        full[:, :ctx] = src
        cache[ids.reshape(-1)] = full.view(b * per_seq, block_size, h, d)
    positions = base["input_positions"].view(b, -1)
    slots = ids.gather(1, positions // block_size) * block_size + positions % block_size
    meta = PagedMetadata(**base, block_tables=ids.to(torch.int32).to(base["query_lens"].device),
                         slot_mapping=slots.reshape(-1).to(base["query_lens"].device), block_size=block_size)
    return k_cache, v_cache, meta


def _contiguous(keys, values, base, gen):
    b, ctx, h, d = keys.shape
    slots = torch.randperm(b + 1, generator=gen)[:b]   # one spare slot, so slot ids are not just 0..b-1
    k_cache = torch.zeros(b + 1, ctx, h, d)
    v_cache = torch.zeros_like(k_cache)
    k_cache[slots], v_cache[slots] = keys, values
    return k_cache, v_cache, ContiguousMetadata(**base, slots=slots.to(base["query_lens"].device))


def dense_attention(q, keys, values, n, scale):
    """q [B*n, H, D] for the last n positions of each sequence; keys/values [B, ctx, H_kv, D]."""
    b, ctx = keys.shape[:2]
    qb = q.view(b, n, q.shape[1], q.shape[2]).transpose(1, 2)           # [B, H, n, D]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        qb, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[2])


# -- timing --------------------------------------------------------------------------------------------------
def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn: Callable, case: Case, repeats: int, device: str) -> dict[str, Any]:
    out = fn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)   # warm-up (and compile) run
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    err = (out.float().cpu() - case.expected).abs().max().item()
    return {"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
            "max_abs_err": err}


def load(decl: KernelDecl) -> tuple[Callable | None, str | None]:
    try:
        return decl.load(), None
    except (ImportError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"


def enable_triton_interpreter(device: str) -> str | None:
    """On CPU, Triton runs only if TRITON_INTERPRET=1 is set before its kernels are decorated."""
    if device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if "kvlab.paged.kernels.triton_paged" in sys.modules:
        return "triton_paged was loaded before kvlab could switch on the Triton interpreter, so it is not timed"
    os.environ["TRITON_INTERPRET"] = "1"      # kvlab's own doing: nothing for the user to set
    return None


class Timer:
    """Times kernels at (spec, phase, shape), loading each implementation once and remembering results."""

    def __init__(self, repeats: int, device: str) -> None:
        self.repeats, self.device = repeats, device
        self.impls: dict[str, tuple[Callable | None, str | None]] = {}
        self.results: list[dict[str, Any]] = []

    def run(self, decl: KernelDecl, spec: AttentionSpec, phase: str, shape: Shape) -> dict[str, Any]:
        fn, error = self.impls.setdefault(decl.name, load(decl))
        row = {"kernel": decl.name, "layout": spec.layout, "phase": phase, "device": spec.device,
               "dtype": spec.dtype, "head_dim": spec.head_dim, "block_size": spec.block_size,
               "gqa_ratio": spec.gqa_ratio, **asdict(shape)}
        reasons = decl.reasons_against(spec, phase)
        if reasons or fn is None:
            row["error"] = "; ".join(reasons) if reasons else error
        else:
            try:
                row.update(time_call(fn, build_case(spec, shape), self.repeats, spec.device))
            except Exception as e:  # noqa: BLE001 - a failing kernel is reported, not fatal to the study
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        tol = TOLERANCE[spec.dtype]
        if row.get("max_abs_err", 0.0) > tol:
            row["error"] = f"wrong result: max abs error {row['max_abs_err']:.3g} > {tol}"
        self.results.append(row)
        return row


# -- the two parts -------------------------------------------------------------------------------------------
def kernel_timings(timer: Timer, device: str, cc, dtypes: tuple[str, ...], progress) -> None:
    jobs = []
    for layout in ("paged", "contiguous"):
        for decl in (d for d in REGISTRY if d.layout == layout):
            for head_dim in HEAD_DIMS:
                for dtype in dtypes:
                    spec = resolve(spec_for(layout, device, cc, dtype, head_dim))
                    for phase in ("decode", "prefill"):
                        if not decl.reasons_against(spec, phase):
                            jobs.append((decl, spec, phase))
    for decl, spec, phase in progress(jobs, "kernel timings"):
        slow = device == "cpu" and decl.name == "triton_paged"
        if slow and (spec.head_dim, spec.dtype) != (HEAD_DIMS[0], "float32"):
            continue
        timer.run(decl, spec, phase, (TINY if slow else SHAPES)[phase])
        if slow:   # the kernel it would replace, on the same tiny shape
            timer.run(by_name("torch_paged"), spec, phase, TINY[phase])


def by_name(name: str) -> KernelDecl:
    return next(d for d in REGISTRY if d.name == name)


def nearest_accepted(decl: KernelDecl, spec: AttentionSpec, phase: str, grid_values: dict[str, tuple]) -> \
        tuple[AttentionSpec | None, str]:
    """The closest spec `decl` accepts, moving only the attributes it refused (block size, dtype, head dim);
    None with the reason when it refuses for something a model cannot change (package, device, GQA)."""
    fixed = [r for r in decl.reasons_against(spec, phase)
             if not r.startswith(("block_size", "dtype", "head_size"))]
    if fixed:
        return None, "; ".join(fixed)
    options = {
        "block_size": [b for b in sorted(grid_values["block_sizes"]) if b >= (spec.block_size or 0)]
        + sorted(grid_values["block_sizes"], reverse=True) if spec.block_size else [None],
        "dtype": [spec.dtype] + [d for d in ("bfloat16", "float16", "float32") if d != spec.dtype],
        "head_dim": [h for h in sorted(grid_values["head_dims"]) if h >= spec.head_dim],
    }
    for head_dim in options["head_dim"]:
        for dtype in options["dtype"]:
            for block in options["block_size"]:
                candidate = replace(spec, head_dim=head_dim, dtype=dtype, block_size=block)
                if not decl.reasons_against(candidate, phase):
                    return candidate, ""
    return None, "no accepted configuration in the grid"


def fallback_costs(timer: Timer, rows: list[Row], scenario: str, grid_values: dict[str, tuple],
                   device: str, cc) -> list[dict[str, Any]]:
    picked = [r for r in rows if r.scenario == scenario]
    costs, timed = [], {}
    for (_, backend, phase, kernel, _), count in fallback_paths(picked).most_common():
        row = next(r for r in picked
                   if (r.backend, r.phase, r.kernel) == (backend, phase, kernel) and r.fallback)
        spec = resolve(spec_for(row.layout, device, cc, row.dtype, row.head_dim, row.block_size,
                                row.gqa_ratio))
        displaced = by_name(row.displaced[0])
        entry = {"backend": backend, "phase": phase, "chosen": kernel, "displaced": displaced.name,
                 "decisions": count, "at": f"head_dim {row.head_dim}, {row.dtype}, block {row.block_size}"}
        key = (spec, phase, kernel, displaced.name)     # paged and elastic share their kernels: timed once
        timed[key] = timed.get(key) or fallback_cost(timer, spec, phase, kernel, displaced, grid_values)
        costs.append({**entry, **timed[key]})
    return costs


def fallback_cost(timer: Timer, spec: AttentionSpec, phase: str, kernel: str, displaced: KernelDecl,
                  grid_values: dict[str, tuple]) -> dict[str, Any]:
    """The chosen kernel's time over the displaced one's at the nearest configuration it accepts."""
    near, why = nearest_accepted(displaced, spec, phase, grid_values)
    if near is None:
        return {"cost": None, "why": f"{displaced.name} cannot run here: {why}"}
    a = timer.run(by_name(kernel), spec, phase, SHAPES[phase])
    b = timer.run(displaced, near, phase, SHAPES[phase])
    ratio = a["median_ms"] / b["median_ms"] if "median_ms" in a and "median_ms" in b else None
    at = f"head_dim {near.head_dim}, {near.dtype}, block {near.block_size}"
    return {"cost": ratio, "why": a.get("error") or b.get("error") or f"displaced kernel timed at {at}"}


def measure(rows: list[Row], threads: int = 1, repeats: int = 10, grid_values: dict[str, tuple] | None = None,
            progress: bool = True) -> dict[str, Any]:
    grid_values = grid_values or {"block_sizes": Grid().block_sizes, "head_dims": Grid().head_dims}
    device, cc = machine()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(rows, threads, repeats, grid_values, progress, device, cc)
    finally:
        torch.set_num_threads(previous_threads)


def _measure(rows, threads, repeats, grid_values, progress, device, cc) -> dict[str, Any]:
    notes = [n for n in [enable_triton_interpreter(device)] if n]

    def bar(jobs, desc):
        if not progress:
            return jobs
        from kvlab.experiments.reporting.tables import progress_bar
        return progress_bar(jobs, desc=desc, leave=False)

    timer = Timer(repeats, device)
    dtypes = ("float32", "bfloat16") if device == "cpu" else ("float32", "float16", "bfloat16")
    kernel_timings(timer, device, cc, dtypes, bar)
    scenario = "cpu" if device == "cpu" else "cuda"
    costs = fallback_costs(timer, rows, scenario, grid_values, device, cc)
    return {"device": device, "compute_capability": cc, "threads": threads, "repeats": repeats,
            "shapes": {k: asdict(v) for k, v in SHAPES.items()},
            "tiny_shapes": {k: asdict(v) for k, v in TINY.items()},
            "notes": notes, "timings": timer.results, "fallback_costs": costs, "scenario": scenario,
            "comparisons": chosen_against_others(timer.results, rows, scenario)}


SAME = 1.10        # closer than this ratio reads as "about as fast": timings here move by ~10% between runs


def chosen_against_others(timings: list[dict[str, Any]], rows: list[Row], scenario: str) -> list[dict[str, Any]]:
    """Every timed kernel against the one the registry chooses at the same point and shape, so a machine where
    nothing is displaced still shows whether the choice is the fastest that runs here."""
    chosen = {(r.layout, r.phase, r.head_dim, r.dtype): r.kernel for r in rows
              if r.scenario == scenario and r.block_size in (None, BLOCK_SIZE)}
    ok = [t for t in timings if "median_ms" in t]
    out = []
    for t in ok:
        pick = chosen.get((t["layout"], t["phase"], t["head_dim"], t["dtype"]))
        if pick is None or t["kernel"] == pick:
            continue
        ref = next((c for c in ok if c["kernel"] == pick and all(c[k] == t[k] for k in (
            "layout", "phase", "head_dim", "dtype", "batch", "context", "query"))), None)
        if ref is not None:
            out.append({"layout": t["layout"], "phase": t["phase"], "head_dim": t["head_dim"], "dtype": t["dtype"],
                        "shape": f"{t['batch']}x{t['context']}", "chosen": pick, "chosen_ms": ref["median_ms"],
                        "other": t["kernel"], "other_ms": t["median_ms"]})
    return out


def comparison_line(c: dict[str, Any]) -> str:
    a, b = c["chosen_ms"], c["other_ms"]
    ratio = max(a, b) / max(min(a, b), 1e-12)
    if ratio < SAME:
        words = f"about as fast as each other (within {SAME - 1:.0%})"
    elif a < b:
        words = f"the chosen {c['chosen']} is faster, x{ratio:.2f}"
    else:
        words = f"{c['other']} is faster than the chosen {c['chosen']}, x{ratio:.2f}"
    return (f"  {c['layout']} {c['phase']} d{c['head_dim']} {c['dtype']} ({c['shape']}): {c['chosen']} "
            f"{a:.3f} ms, {c['other']} {b:.3f} ms: {words}")


# -- printing ------------------------------------------------------------------------------------------------
def format_timings(result: dict[str, Any]) -> str:
    dec, pre = SHAPES["decode"], SHAPES["prefill"]
    lines = [(f"Measured on this machine: {result['device']}, {result['threads']} torch thread(s), median of "
              f"{result['repeats']} after a warm-up; decode B={dec.batch} x ctx {dec.context}; prefill "
              f"B={pre.batch} x {pre.query} new tokens after {pre.context - pre.query} past; "
              f"H={GQA * NUM_KV_HEADS}, H_kv={NUM_KV_HEADS}")]
    lines += [f"  note: {n}" for n in result["notes"]]
    lines.append(f"  {'kernel':<22} {'phase':<8} {'head_dim':>8} {'dtype':<9} {'block':>5} {'B x ctx':>9} "
                 f"{'median ms':>10} {'p90 ms':>8} {'max err':>9}")
    for t in result["timings"]:
        head = (f"  {t['kernel']:<22} {t['phase']:<8} {t['head_dim']:>8} {t['dtype']:<9} "
                f"{t['block_size'] or '-'!s:>5} {t['batch']}x{t['context']:<6}")
        if "error" in t:
            lines.append(f"{head}  not timed: {t['error']}")
        else:
            lines.append(f"{head} {t['median_ms']:>10.3f} {t['p90_ms']:>8.3f} {t['max_abs_err']:>9.2e}")
    lines += ratio_lines(result["timings"])
    lines.append(f"Fallback costs ({result['scenario']} scenario: chosen / displaced time)")
    if not result["fallback_costs"]:
        lines.append(f"  none: no kernel is displaced on {result['device']} in this grid (its first-priority "
                     "kernels accept every configuration)")
    for c in result["fallback_costs"]:
        cost = f"{c['cost']:.2f}x" if c["cost"] is not None else "n/a"
        lines.append(f"  {c['backend']} {c['phase']}: {c['chosen']} instead of {c['displaced']} "
                     f"({c['decisions']} decisions, e.g. {c['at']}): {cost}; {c['why']}")
    comparisons = result.get("comparisons", [])
    if comparisons:
        lines.append("Chosen kernel against every other kernel that runs here (same point, same shape)")
        lines += [comparison_line(c) for c in comparisons]
    return "\n".join(lines)


def ratio_lines(timings: list[dict[str, Any]]) -> list[str]:
    """paged (torch gather) vs contiguous (SDPA) per point, and triton vs torch on the tiny shape."""
    ok = {(t["kernel"], t["phase"], t["head_dim"], t["dtype"], t["context"]): t["median_ms"]
          for t in timings if "error" not in t}
    lines = []
    for (kernel, phase, head_dim, dtype, ctx), ms in ok.items():
        if kernel != "torch_paged":
            continue
        contiguous = ok.get(("torch_sdpa_contiguous", phase, head_dim, dtype, ctx))
        triton = ok.get(("triton_paged", phase, head_dim, dtype, ctx))
        if contiguous:
            lines.append(f"  {phase} d{head_dim} {dtype}: torch_paged / torch_sdpa_contiguous = "
                         f"{ms / contiguous:.2f}x")
        if triton:
            lines.append(f"  {phase} d{head_dim} {dtype}, tiny shape: triton_paged (interpreted) / "
                         f"torch_paged = {triton / ms:.0f}x")
    return lines
