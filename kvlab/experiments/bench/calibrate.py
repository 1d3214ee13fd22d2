"""`kvlab calibrate`: measure this machine's map/unmap latency per page size with the host VMM driver
(vmm/drivers/host.py: memfd pool allocated at creation, MAP_FIXED mappings populated at map time) and write the
`host` driver profile that `kvlab simulate serve --driver-costs host` reads. `kvlab calibrate --kernels` measures
the kernels part instead (bench/kernel_costs.py: contiguous SDPA against the paged gather path) and writes the
kernel profile that `--kernel-costs cpu` reads."""
from __future__ import annotations

import argparse
import json
import mmap
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.machine import check_fits_in_ram, fmt_bytes
from kvlab.common.validate import check_int, is_digits
from kvlab.experiments.bench.kernel_costs import Grid, measure_profile
from kvlab.experiments.cli import flags
from kvlab.experiments.sim.kernels import DEFAULT_KERNEL_PROFILE
from kvlab.experiments.sim.serve.costs import DEFAULT_CALIBRATION

MMAP_PAGE = mmap.PAGESIZE
MAX_PAGE_BYTES = 2**30


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("calibrate", help="measure host map/unmap latency per page size (driver profile)",
                              description="Map and unmap pool pages one call per page with the host VMM driver; "
                                          "write the medians as the `host` driver profile.")
    p.add_argument("--page-sizes", type=page_sizes, default=page_sizes("64KiB,2MiB"),
                   help="comma list of sizes, each a multiple of the host page size")
    p.add_argument("--pages", type=int, default=64, help="pages mapped then unmapped per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help=f"JSON to write (default {DEFAULT_CALIBRATION}; with --kernels, "
                                 f"{DEFAULT_KERNEL_PROFILE})")
    p.add_argument("--kernels", action="store_true",
                   help="measure the kernels part (the kernel profile of --kernel-costs cpu) instead of the driver")
    p.add_argument("--contexts", type=flags.parse_list, default=["512", "2048", "8192"],
                   help="--kernels: decode context lengths")
    p.add_argument("--prefill-contexts", type=flags.parse_list, default=["128", "512"],
                   help="--kernels: prefill lengths (a whole prompt)")
    p.add_argument("--block-sizes", type=flags.parse_list, default=["16", "32", "128"], help="--kernels: paged")
    p.add_argument("--batch", type=int, default=4, help="--kernels: sequences per step")
    p.add_argument("--threads", type=int, default=1, help="--kernels: torch threads (pinned for stable timings)")
    p.set_defaults(run=run)


def page_sizes(text: str) -> list[tuple[str, int]]:
    """'64KiB,2MiB' -> [("64KiB", 65536), ("2MiB", 2097152)]."""
    sizes = [(item, flags.parse_bytes(item)) for item in flags.parse_list(text)]
    for item, size in sizes:
        if not MMAP_PAGE <= size <= MAX_PAGE_BYTES or size % MMAP_PAGE:
            raise argparse.ArgumentTypeError(f"page size {item!r} must be a multiple of {MMAP_PAGE} bytes, at most "
                                             f"{MAX_PAGE_BYTES // 2**30} GiB")
    return sizes


def check_args(args: argparse.Namespace) -> None:
    """Counts bounded, the pool fits in RAM and --out is writable, before anything is measured or printed."""
    pages = check_int("--pages", args.pages, 1, 1 << 16)
    check_int("--repeats", args.repeats, 1, 1000)
    largest = max(size for _, size in args.page_sizes)
    check_fits_in_ram(f"--pages {pages} of {fmt_bytes(largest)}", pages * largest, "lower --pages")
    flags.check_output_path(args.out, "--out")


def measure(page_size: int, pages: int, repeats: int) -> dict[str, float]:
    """Median seconds per page of map (populating the page) and of unmap, one driver call per page."""
    from kvlab.vmm.drivers.host import HostVirtualMemory
    vm = HostVirtualMemory(page_size)
    maps, unmaps = [], []
    try:
        vm.create_store(pages)
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
    return calibrate_kernels(args) if args.kernels else calibrate_driver(args)


def calibrate_driver(args: argparse.Namespace) -> int:
    check_args(args)
    table = {}
    for text, size in args.page_sizes:
        table[str(size)] = measure(size, args.pages, args.repeats)
        print(f"{text:>8}: map {table[str(size)]['map_s'] * 1e6:8.2f} us/page, "
              f"unmap {table[str(size)]['unmap_s'] * 1e6:8.2f} us/page")
    out = Path(args.out or DEFAULT_CALIBRATION)
    out.parent.mkdir(parents=True, exist_ok=True)
    from kvlab.experiments.reporting.provenance import provenance
    record = provenance({"command": "calibrate", "page_sizes": list(table), "pages": args.pages,
                         "repeats": args.repeats})
    out.write_text(json.dumps({"machine": platform.platform(), "driver": "host", "page_sizes": table,
                               "provenance": record}, indent=1))
    print(f"host driver profile written to {out}")
    return 0


def kernel_grid(args: argparse.Namespace) -> Grid:
    ints = lambda flag, items: tuple(positive_int(flag, x) for x in items)    # noqa: E731
    check_int("--batch", args.batch, 1, 1024)
    check_int("--repeats", args.repeats, 1, 1000)
    return Grid(batch=args.batch, decode_contexts=ints("--contexts", args.contexts),
                prefill_contexts=ints("--prefill-contexts", args.prefill_contexts),
                block_sizes=ints("--block-sizes", args.block_sizes), repeats=args.repeats)


def positive_int(flag: str, text: str) -> int:
    if not is_digits(str(text)) or int(text) < 1:
        raise ConfigError(f"{flag} takes positive integers, got {text!r}")
    return int(text)


def calibrate_kernels(args: argparse.Namespace) -> int:
    import torch
    grid = kernel_grid(args)
    check_int("--threads", args.threads, 1, 256)
    torch.set_num_threads(args.threads)
    doc = measure_profile(grid, "cpu", "cpu", f"kvlab calibrate --kernels on {platform.processor() or 'cpu'}, "
                                              f"{args.threads} thread(s), {grid.dtype}")
    for p in doc["points"]:
        print(f"{p['phase']:>8} ctx {p['context']:>6} block {p['block_size']:>4}: contiguous "
              f"{p['contiguous_s'] * 1e3:8.3f} ms, paged {p['paged_s'] * 1e3:8.3f} ms, x{p['ratio']:.2f}")
    out = Path(args.out or DEFAULT_KERNEL_PROFILE)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"kernel profile written to {out} (kvlab simulate --kernel-costs cpu reads {DEFAULT_KERNEL_PROFILE})")
    return 0
