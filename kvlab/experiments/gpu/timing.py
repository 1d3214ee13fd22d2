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
