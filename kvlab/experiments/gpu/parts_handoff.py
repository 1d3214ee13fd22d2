"""The GPU check's handoff_copy part: what moving a request's KV costs, by remapping or by copying. For n pages
of 2 MiB (n x 2 MiB of KV):

- remap, per page: cuMemExportToShareableHandle (a POSIX descriptor), cuMemImportFromShareableHandle, cuMemMap
  + cuMemSetAccess at a new address; each call on perf_counter_ns. Import here is in the exporting process (the
  descriptor passing between processes, an SCM_RIGHTS message, is not timed); the cuda_pool part checks the
  two-process path;
- copy, device to device, of the same bytes: contiguous (one copy, a vmm range) and block-scattered (16-token
  blocks of one layer's K or V for Llama-3-8B, 32 KiB each, at shuffled places: one gather kernel, and one copy
  per block as a transfer per block would issue them, the latter only up to 4,096 blocks).

CPU dry run: the recording fake for the driver calls, host tensors for the copies, n = 1, 2."""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from kvlab.experiments.gpu.driver import Driver, allocation_prop
from kvlab.experiments.gpu.timing import device_timer, ns_call, part_deadline

BLOCK_BYTES = 16 * 8 * 128 * 2          # 16 tokens x 8 KV heads x d 128 x bf16: one layer's K (or V) block
MAX_BLOCK_COPIES = 4096
GPU_PAGES, DRY_PAGES = (8, 64, 512), (1, 2)


def part_handoff_copy(dry: bool) -> dict[str, Any]:
    device = "cpu" if dry else "cuda"
    d = Driver(dry)
    deadline = part_deadline()
    rows: list[dict[str, Any]] = []
    try:
        page = d.granularity("MINIMUM")
        for n in DRY_PAGES if dry else GPU_PAGES:
            if time.perf_counter() > deadline:
                rows.append({"pages": n, "not_measured": "the part's time budget is spent"})
                continue
            rows.append({"pages": n, "bytes": n * page, "remap": remap(d, n, page),
                         "copy": copies(device, n * page, 2 if dry else 10)})
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        d.close()
    out: dict[str, Any] = {"device": device, "block_bytes": BLOCK_BYTES, "rows": rows}
    if all("not_measured" in row for row in rows):
        out["failed"] = "no size measured within the part's time budget"
    if dry:
        out["fake_leaks"] = {k: str(v) for k, v in d.drv.leaks().items()}
    return out


def exportable_prop(d: Driver) -> Any:
    prop = allocation_prop(d.drv)
    prop.requestedHandleTypes = posix_fd(d)
    return prop


def posix_fd(d: Driver) -> Any:
    return d.drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def remap(d: Driver, n: int, page: int) -> dict[str, Any]:
    """Export, import and map n exportable pages at a second address; microseconds per page of each step."""
    times: dict[str, list[float]] = {"export": [], "import": [], "map_and_set_access": []}
    prop = exportable_prop(d)
    owned = [d.call("cuMemCreate", page, prop, 0) for _ in range(n)]
    imported, fds = [], []
    base = d.reserve(n * page)
    mapped = 0
    try:
        for i, handle in enumerate(owned):
            fd, s = ns_call(lambda h=handle: d.call("cuMemExportToShareableHandle", h, posix_fd(d), 0))
            fds.append(int(fd))
            times["export"].append(s)
            other, s = ns_call(lambda f=fds[-1]: d.call("cuMemImportFromShareableHandle", f, posix_fd(d)))
            imported.append(other)
            times["import"].append(s)
            times["map_and_set_access"].append(ns_call(lambda p=base + i * page, h=other: d.map(p, page, h))[1])
            mapped += 1
    finally:
        d.call("cuCtxSynchronize")
        for i in range(mapped):
            d.call("cuMemUnmap", base + i * page, page)
        d.call("cuMemAddressFree", base, n * page)
        for handle in {int(h): h for h in imported + owned}.values():   # an import may return its own handle
            d.call("cuMemRelease", handle)
        for fd in fds:
            os.close(fd)
    per_page = {f"{k}_us_median": statistics.median(v) * 1e6 for k, v in times.items()}
    total = sum(sum(v) for v in times.values())
    same = sum(int(a) == int(b) for a, b in zip(imported, owned))
    return {**per_page, "total_ms": total * 1e3, "per_page_us": total / n * 1e6, "imports_returning_own_handle": same}


def copies(device: str, nbytes: int, repeats: int) -> dict[str, Any]:
    """Milliseconds to copy nbytes device to device: contiguous, gathered from scattered blocks, block by block."""
    blocks = nbytes // BLOCK_BYTES
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    pool = src.view(blocks, BLOCK_BYTES)
    order = torch.randperm(blocks, device=device)
    out_blocks = dst.view(blocks, BLOCK_BYTES)
    out: dict[str, Any] = {
        "contiguous_ms": device_timer(device, lambda: dst.copy_(src), repeats)["median"],
        "scattered_gather_ms": device_timer(device, lambda: torch.index_select(pool, 0, order, out=out_blocks),
                                            repeats)["median"],
        "blocks": blocks}
    if blocks <= MAX_BLOCK_COPIES:
        ids = order.tolist()

        def per_block() -> None:
            for j, b in enumerate(ids):
                out_blocks[j].copy_(pool[b])
        out["scattered_per_block_copy_ms"] = device_timer(device, per_block, max(2, repeats // 3))["median"]
    if not torch.equal(out_blocks, pool[order]):
        raise AssertionError("the scattered copy did not produce the gathered blocks")
    return out
