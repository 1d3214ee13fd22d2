"""The GPU check's part for the pool's CUDA pages (vmm/pool/cuda_chunks.py, docs/pool.md "CUDA handles"): two
processes on one device. This one creates two exportable chunks, maps page 3 and fills it with 0xA5, and exports
the chunks as descriptors; a child process imports them, maps page 3 and reads it back, fills page 0 with 0x5A,
tries to export an imported chunk again (can a member other than the creator serve joins?), and tears down; this
one then reads page 0 and tears down. The child is bounded in time. With `dry` both processes use the recording
fake, whose chunks share their bytes through memfds."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Any

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.cuda_device import CudaDevice
from kvlab.vmm.pool.cuda_chunks import CudaChunks, posix_fd

CHILD_SECONDS = 60
FILL_PARENT, FILL_CHILD = 0xA5, 0x5A
CHILD = "import sys; from kvlab.experiments.gpu.parts_pool import child_main; sys.exit(child_main(sys.argv[1:]))"


def device(dry: bool) -> CudaDevice:
    if dry:
        from kvlab.experiments.gpu.driver import fake_driver
        return CudaDevice(0, fake_driver())
    return CudaDevice(0)


def filled(cuda: CudaDevice, va: int, nbytes: int, value: int) -> bool:
    """Whether the mapped bytes at va all equal `value` (read to the host)."""
    buf = (ctypes.c_char * nbytes)()
    cuda.call("cuCtxSynchronize")
    cuda.call("cuMemcpyDtoH", ctypes.addressof(buf), va, nbytes)
    return bytes(buf) == bytes([value]) * nbytes


def fill(cuda: CudaDevice, va: int, nbytes: int, value: int) -> None:
    cuda.call("cuMemsetD8", va, value, nbytes)
    cuda.call("cuCtxSynchronize")


def part_cuda_pool(dry: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    cuda = device(dry)
    page = cuda.granularity
    chunks = CudaChunks.create(cuda, 4 * page, 2 * page, page)
    va = int(cuda.call("cuMemAddressReserve", 2 * page, 0, 0, 0))
    out: dict[str, Any] = {"granularity": page, "chunks": len(chunks.handles), "chunk_bytes": 2 * page}
    try:
        chunks.map(va, 3)
        fill(cuda, va, page, FILL_PARENT)
        out["child"] = run_child(chunks.export(), page)
        chunks.map(va + page, 0)
        out["parent_reads_child_write"] = filled(cuda, va + page, page, FILL_CHILD)
    finally:
        for at in (va, va + page):
            try:
                chunks.unmap(at)
            except DriverError:          # not mapped (an earlier step failed): nothing to undo
                pass
        cuda.call("cuMemAddressFree", va, 2 * page)
        chunks.close()
        cuda.release_primary(log_errors=True)
        if dry:
            out["fake_leaks"] = cuda.drv.leaks()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    problems = [k for k in ("child_reads_parent_write", "child_ok") if not out["child"].get(k)]
    problems += [] if out["parent_reads_child_write"] else ["parent_reads_child_write"]
    problems += ["fake_leaks"] if out.get("fake_leaks") else []
    if problems:
        out["failed"] = "failed: " + ", ".join(problems)
    return out


def run_child(fds: list[int], page: int) -> dict[str, Any]:
    """The importing process, bounded in time; the descriptors are closed here once it has them."""
    dry = "--dry" if os.environ.get("TRITON_INTERPRET") == "1" else "--gpu"
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, dry, str(page), *map(str, fds)], pass_fds=fds,
                              capture_output=True, text=True, timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        return {"child_ok": False, "error": f"the importing process ran past {CHILD_SECONDS} s"}
    finally:
        for fd in fds:
            os.close(fd)
    if proc.returncode != 0:
        return {"child_ok": False, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(argv: list[str]) -> int:
    """Import the chunks, read page 3, fill page 0, try a re-export, tear down; print one JSON line."""
    cuda = device(argv[0] == "--dry")
    page, fds = int(argv[1]), [int(fd) for fd in argv[2:]]
    chunks = CudaChunks.imported(cuda, fds, 2 * page, page)
    va = int(cuda.call("cuMemAddressReserve", 2 * page, 0, 0, 0))
    chunks.map(va, 3)
    chunks.map(va + page, 0)
    out = {"child_reads_parent_write": filled(cuda, va, page, FILL_PARENT), "reexport_of_import": reexport(chunks)}
    fill(cuda, va + page, page, FILL_CHILD)
    for at in (va, va + page):
        chunks.unmap(at)
    cuda.call("cuMemAddressFree", va, 2 * page)
    chunks.close()
    cuda.release_primary(log_errors=True)
    print(json.dumps({**out, "child_ok": True}), flush=True)
    return 0


def reexport(chunks: CudaChunks) -> str:
    """Whether an imported chunk exports again (if not, only the creator can serve joins: docs/pool.md)."""
    try:
        fd = int(chunks.cuda.call("cuMemExportToShareableHandle", chunks.handles[0], posix_fd(chunks.cuda.drv), 0))
    except DriverError as exc:
        return f"refused: {exc}"
    os.close(fd)
    return "ok"
