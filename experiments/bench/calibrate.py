"""`kvlab calibrate`: measure this machine's map/unmap latency per page size with the host VMM driver
(vmm/drivers/host.py: memfd pool, MAP_FIXED mappings, populated at map time) and write the `host` driver
profile that `kvlab simulate serve --driver-costs host` reads."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from kvlab.experiments.cli import flags
from kvlab.experiments.sim.serve.costs import DEFAULT_CALIBRATION


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("calibrate", help="measure host map/unmap latency per page size (driver profile)",
                              description="Map and unmap pool pages one call per page with the host VMM driver; "
                                          "write the medians as the `host` driver profile.")
    p.add_argument("--page-sizes", type=flags.parse_list, default=["64KiB", "2MiB"])
    p.add_argument("--pages", type=int, default=64, help="pages mapped then unmapped per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(DEFAULT_CALIBRATION), help="JSON to write")
    p.set_defaults(run=run)


def measure(page_size: int, pages: int, repeats: int) -> dict[str, float]:
    """Median seconds per page of map (populating the page) and of unmap, one driver call per page."""
    from kvlab.vmm.drivers.host import HostVirtualMemory
    vm = HostVirtualMemory(page_size)
    maps, unmaps = [], []
    try:
        vm.create_pool(pages)
        region = vm.reserve(pages * page_size)
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(pages):
                vm.map(region, i * page_size, i)
            t1 = time.perf_counter()
            for i in range(pages):
                vm.unmap(region, i * page_size)
            t2 = time.perf_counter()
            maps.append((t1 - t0) / pages)
            unmaps.append((t2 - t1) / pages)
        vm.release(region)
    finally:
        vm.close()
    return {"map_s": statistics.median(maps), "unmap_s": statistics.median(unmaps), "pages": pages,
            "repeats": repeats}


def run(args: argparse.Namespace) -> int:
    table = {}
    for text in args.page_sizes:
        size = flags.parse_bytes(text)
        table[str(size)] = measure(size, args.pages, args.repeats)
        print(f"{text:>8}: map {table[str(size)]['map_s'] * 1e6:8.2f} us/page, "
              f"unmap {table[str(size)]['unmap_s'] * 1e6:8.2f} us/page")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from kvlab.experiments.reporting.provenance import provenance
    record = provenance({"command": "calibrate", "page_sizes": list(table), "pages": args.pages,
                         "repeats": args.repeats})
    out.write_text(json.dumps({"machine": platform.platform(), "driver": "host", "page_sizes": table,
                               "provenance": record}, indent=1))
    print(f"host driver profile written to {out}")
    return 0
