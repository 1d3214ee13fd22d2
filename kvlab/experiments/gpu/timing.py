"""Timing for the GPU check's parts: per-call summaries, device-side timing, and the per-call latency of the
VMM driver calls (create, map, set-access, unmap, release) with free device memory around them."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

MiB = 2**20
VMM_CALLS = ("create", "map", "set_access", "unmap", "release")


def summary(samples: list[float], scale: float = 1e6) -> dict[str, float]:
    """Median and p90 of per-call seconds, in microseconds by default."""
    ordered = sorted(samples)
    return {"median": statistics.median(ordered) * scale, "p90": ordered[int(0.9 * (len(ordered) - 1))] * scale,
            "calls": len(ordered)}


def device_timer(device: str, fn: Callable[[], Any], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median/p90 milliseconds per call: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    return summary([one_call_seconds(device, fn) for _ in range(repeats)], 1e3)


def one_call_seconds(device: str, fn: Callable[[], Any]) -> float:
    if device != "cuda":
        return timed_call(fn, device)
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def timed_call(fn: Callable[[], Any], device: str) -> float:
    """Host seconds of one call, synchronised on a GPU."""
    import torch
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def per_call_latency(call: Callable[..., Any], prop: Any, access: list, page: int, pages: int,
                     free: Callable[[], int | None]) -> dict[str, Any]:
    """Every VMM call one page at a time through `call(name, *args)` (a checked driver call), timed on the
    host, with `free()` device bytes before and after creating and mapping."""
    times: dict[str, list[float]] = {k: [] for k in VMM_CALLS}

    def timed(kind: str, name: str, *args: Any) -> Any:
        t0 = time.perf_counter()
        value = call(name, *args)
        times[kind].append(time.perf_counter() - t0)
        return value
    seen = {"before_create": free()}
    base = int(call("cuMemAddressReserve", pages * page, 0, 0, 0))
    handles = [timed("create", "cuMemCreate", page, prop, 0) for _ in range(pages)]
    seen["after_create"] = free()
    for i, h in enumerate(handles):
        timed("map", "cuMemMap", base + i * page, page, 0, h, 0)
        timed("set_access", "cuMemSetAccess", base + i * page, page, access, 1)
    seen["after_map"] = free()
    call("cuCtxSynchronize")           # unmap does not wait for kernels (CUDA driver API docs)
    for i in range(pages):
        timed("unmap", "cuMemUnmap", base + i * page, page)
    for h in handles:
        timed("release", "cuMemRelease", h)
    call("cuMemAddressFree", base, pages * page)
    seen["after_release"] = free()
    return {"page_bytes": page, "pages": pages, "us": {k: summary(v) for k, v in times.items()},
            "mem_get_info_free_bytes": seen, **memory_seen(seen)}


def memory_seen(seen: dict[str, int | None]) -> dict[str, float]:
    if seen["before_create"] is None:
        return {}
    return {"created_mib_seen_by_mem_get_info": (seen["before_create"] - seen["after_create"]) / MiB,
            "mapped_mib_seen_by_mem_get_info": (seen["before_create"] - seen["after_map"]) / MiB}


def part_deadline(share: float = 0.75) -> float:
    """perf_counter time by which a part stops adding points: `share` of its own timeout (the harness passes
    it in the environment), so it writes what it measured before the harness kills it."""
    import os

    from kvlab.experiments.gpu.harness import PART_TIMEOUT_ENV
    return time.perf_counter() + share * float(os.environ.get(PART_TIMEOUT_ENV, "60"))


def ns_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(value, seconds) of one host call, on the nanosecond counter (driver calls take about a microsecond)."""
    t0 = time.perf_counter_ns()
    value = fn()
    return value, (time.perf_counter_ns() - t0) / 1e9


class GraphTimer:
    """GPU seconds per call of `fn`: on a GPU `inner` calls captured in one CUDA graph and replayed between two
    events, so Python launch overhead (tens of microseconds for a Triton launch) does not hide a short kernel;
    where capture fails, events around `inner` eager calls, with the reason kept in `fallback`. On the CPU,
    perf_counter around the eager calls."""

    def __init__(self, device: str, fn: Callable[[], Any], inner: int = 8) -> None:
        self.device, self.fn, self.inner = device, fn, inner
        self.graph = None
        self.fallback = ""
        if device == "cuda":
            fn()                              # compiles on first use (the interpreter compiles nothing)
            self.graph = self._capture()

    def _capture(self) -> Any:
        import torch
        try:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(self.inner):
                    self.fn()
            graph.replay()
            torch.cuda.synchronize()
            return graph
        except Exception as exc:  # noqa: BLE001 - the fallback is recorded with its reason
            self.fallback = f"CUDA graph capture failed, eager launches timed instead: {type(exc).__name__}: {exc}"
            return None

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.inner):
                self.fn()

    def seconds(self) -> float:
        return one_call_seconds(self.device, self.run) / self.inner


def paired_seconds(a: GraphTimer, b: GraphTimer, repeats: int) -> tuple[float, float]:
    """Median seconds per call of each, their timings alternated so that drift falls on both alike."""
    pairs = [(a.seconds(), b.seconds()) for _ in range(repeats)]
    return statistics.median(x for x, _ in pairs), statistics.median(y for _, y in pairs)
