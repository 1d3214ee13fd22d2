"""The GPU check's vmm_sizes part: cuMemMap / cuMemSetAccess / cuMemUnmap latency against range size, n x 2 MiB
for n = 1, 2, 4, ..., 512, on the nanosecond counter (one call takes about a microsecond), the driver used
directly (experiments/gpu/driver.py). Two ways to back a range of n pages:

- one handle of n x 2 MiB: one cuMemCreate, one cuMemMap, one cuMemSetAccess, one cuMemUnmap (per call, and
  per 2 MiB page: the call divided by n). These per-call figures against size are the driver profile the
  simulator reads as `--driver-costs measured:gpu_check.json` (`driver_figures`, sim/serve/measured_driver.py);
- n handles of 2 MiB (what a cache that maps page by page does): n cuMemMap calls, then cuMemSetAccess per page
  (n calls, vAttention's way) or per run (one call over the n mappings, kvlab's), and cuMemUnmap per page or
  per run (one call over n mappings; where the driver refuses, the error is the finding).

The CPU dry run: the recording fake, n = 1, 2, 4 (plumbing, not latencies)."""
from __future__ import annotations

import statistics
import time
from typing import Any

from kvlab.experiments.gpu.driver import Driver, DriverCallError
from kvlab.experiments.gpu.timing import ns_call, part_deadline

FIGURES_FORMAT = "kvlab-driver-figures/1"
GPU_SIZES = tuple(2**i for i in range(10))         # 1 .. 512 pages of 2 MiB
DRY_SIZES = (1, 2, 4)


def part_vmm_sizes(dry: bool) -> dict[str, Any]:
    d = Driver(dry)
    page = d.granularity("MINIMUM")
    sizes = DRY_SIZES if dry else GPU_SIZES
    deadline = part_deadline()
    pool: list[Any] = []
    rows, skipped = [], []
    try:
        pool = [d.call("cuMemCreate", page, d.prop, 0) for _ in range(max(sizes))]
        for n in sizes:
            if time.perf_counter() > deadline:
                skipped.append(n)
                continue
            reps = 2 if dry else (7 if n <= 64 else 3)
            rows.append({"pages": n, "bytes": n * page, "one_handle": one_handle(d, n * page, reps),
                         "page_handles": page_handles(d, pool[:n], page, reps)})
    finally:
        d.call("cuCtxSynchronize")
        for h in pool:
            d.call("cuMemRelease", h)
        d.close()
    out: dict[str, Any] = {"driver": "recording fake" if dry else "cuda.bindings.driver", "page_bytes": page,
                           "timer": "time.perf_counter_ns around each call", "sizes": rows,
                           "driver_figures": figures(rows, page, dry)}
    if skipped:
        out["not_measured_time_budget"] = skipped
    if not rows:
        out["failed"] = "no range size measured within the part's time budget"
    if dry:
        out["fake_leaks"] = {k: str(v) for k, v in d.drv.leaks().items()}
    return out


def one_handle(d: Driver, size: int, reps: int) -> dict[str, Any]:
    """Median microseconds of each call on one handle of `size` bytes, `reps` times."""
    times: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap")}

    def timed(kind: str, name: str, *args: Any) -> Any:
        value, seconds = ns_call(lambda: d.call(name, *args))
        times[kind].append(seconds)
        return value
    for _ in range(reps):
        base = d.reserve(size)
        handle = timed("create", "cuMemCreate", size, d.prop, 0)
        timed("map", "cuMemMap", base, size, 0, handle, 0)
        timed("set_access", "cuMemSetAccess", base, size, d.access, 1)
        d.call("cuCtxSynchronize")
        timed("unmap", "cuMemUnmap", base, size)
        d.call("cuMemRelease", handle)
        d.call("cuMemAddressFree", base, size)
    return {f"{k}_us": median_us(v) for k, v in times.items()}


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def page_handles(d: Driver, handles: list[Any], page: int, reps: int) -> dict[str, Any]:
    """n separately created 2 MiB handles mapped page by page; set-access and unmap per page and per run."""
    n, size = len(handles), len(handles) * page
    per_page: dict[str, list[float]] = {"map": [], "set_access": [], "unmap": []}
    per_run: dict[str, list[float]] = {"set_access": [], "unmap": []}
    errors: dict[str, str] = {}
    base = d.reserve(size)
    try:
        for _ in range(reps):
            per_page["map"].append(map_pages(d, base, handles, page))
            per_page["set_access"].append(sum(ns_call(lambda i=i: d.call(
                "cuMemSetAccess", base + i * page, page, d.access, 1))[1] for i in range(n)))
            d.call("cuCtxSynchronize")
            per_page["unmap"].append(unmap_pages(d, base, n, page))
            map_pages(d, base, handles, page)
            try:
                per_run["set_access"].append(ns_call(lambda: d.call("cuMemSetAccess", base, size, d.access, 1))[1])
            except DriverCallError as exc:          # one call over n mappings refused: the finding
                errors["set_access_per_run_error"] = exc.result
            d.call("cuCtxSynchronize")
            try:
                per_run["unmap"].append(ns_call(lambda: d.call("cuMemUnmap", base, size))[1])
            except DriverCallError as exc:
                errors["unmap_per_run_error"] = exc.result
                unmap_pages(d, base, n, page)
    finally:
        d.call("cuMemAddressFree", base, size)
    out = {f"{k}_per_page_total_us": median_us(v) for k, v in per_page.items()}
    out.update({f"{k}_per_run_us": median_us(v) for k, v in per_run.items() if v})
    out["map_us_per_call"] = out["map_per_page_total_us"] / n
    out["set_access_us_per_page_call"] = out["set_access_per_page_total_us"] / n
    return {**out, **errors}


def map_pages(d: Driver, base: int, handles: list[Any], page: int) -> float:
    return sum(ns_call(lambda i=i, h=h: d.call("cuMemMap", base + i * page, page, 0, h, 0))[1]
               for i, h in enumerate(handles))


def unmap_pages(d: Driver, base: int, n: int, page: int) -> float:
    return sum(ns_call(lambda i=i: d.call("cuMemUnmap", base + i * page, page))[1] for i in range(n))


def figures(rows: list[dict[str, Any]], page: int, dry: bool) -> dict[str, Any]:
    """Per-call seconds of each call against the bytes it covers (one handle per range): the driver profile
    `measured:FILE` reads."""
    return {"format": FIGURES_FORMAT, "page_bytes": page,
            "source": "GPU check vmm_sizes" + (" (CPU dry run: the recording fake, not a GPU)" if dry else ""),
            "points": [{"bytes": r["bytes"], **{f"{k}_s": r["one_handle"][f"{k}_us"] / 1e6
                                                 for k in ("create", "map", "set_access", "unmap")}}
                       for r in rows]}
