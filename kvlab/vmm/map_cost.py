"""Measure the host driver's per-page map/unmap cost: `python -m vmm.map_cost [--json]`.

One page per call, 1 thread, median and p90 in microseconds, through `HostVirtualMemory.map/unmap` (bookkeeping
included, as the cache pays it). Rows: the first map of a pool page (MAP_POPULATE allocates and zeroes it), a map
of a page the pool already holds, a lazy map (no MAP_POPULATE; the fault cost moves to first touch), an unmap.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvlab.vmm.drivers.host import HostVirtualMemory

KiB, MiB = 1024, 1024**2
SIZES = {4 * KiB: 4096, 64 * KiB: 2048, 2 * MiB: 256}   # page size -> pages measured


def _timed_each(fn, count: int) -> list[float]:
    out = []
    for i in range(count):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_us": round(statistics.median(ordered), 2), "p90_us": round(ordered[int(0.9 * len(ordered))], 2)}


def measure(page_size: int, count: int) -> dict[str, dict[str, float]]:
    results = {}
    vm = HostVirtualMemory(page_size, populate=True)
    region = vm.reserve(count * page_size)
    vm.create_pool(count)
    results["map (fresh pool page, populate)"] = _summary(_timed_each(lambda i: vm.map(region, i * page_size, i),
                                                                      count))
    results["unmap"] = _summary(_timed_each(lambda i: vm.unmap(region, i * page_size), count))
    results["map (pool page already held)"] = _summary(_timed_each(lambda i: vm.map(region, i * page_size, i),
                                                                   count))
    vm.close()
    lazy = HostVirtualMemory(page_size, populate=False)
    region = lazy.reserve(count * page_size)
    lazy.create_pool(count)
    results["map (lazy, no populate)"] = _summary(_timed_each(lambda i: lazy.map(region, i * page_size, i), count))
    lazy.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {f"{size // KiB} KiB": measure(size, count) for size, count in SIZES.items()}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    rows = list(next(iter(report.values())))
    print(f"{'operation (one page per call)':36}" + "".join(f"{name:>22}" for name in report))
    for row in rows:
        cells = "".join(f"{report[n][row]['median_us']:>10.2f} ({report[n][row]['p90_us']:>8.2f})" for n in report)
        print(f"{row:36}{cells}")
    print("median us (p90 us), 1 thread")


if __name__ == "__main__":
    main()
