"""The pool's pages on a GPU (vmm/pool/cuda_chunks.py) against the fake driver: the fake's rules for sharing an
allocation (exportable only if created so, a POSIX descriptor only, memory released only when every handle and
mapping is gone), and chunks created in one "process", imported in another (a second fake in this process, and a
real second process), written through one and read through the other."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
from fakes.fake_cuda import INVALID_VALUE, OK, FakeCudaDriver

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.cuda_device import CudaDevice
from kvlab.vmm.pool.cuda_chunks import CudaChunks, exportable_prop
from kvlab.vmm.pool.errors import LimitError

GRAN = 2 << 20
PATTERN = bytes(range(256)) * (GRAN // 256)


@pytest.fixture
def fake():
    fake = FakeCudaDriver(granularity=GRAN)
    yield fake
    assert fake.leaks() == {} and fake.mem.live_allocations() == 0


@pytest.fixture
def cuda(fake):
    device = CudaDevice(0, fake)
    yield device
    device.release_primary(log_errors=False)


def reserve(cuda: CudaDevice, pages: int) -> int:
    return int(cuda.call("cuMemAddressReserve", pages * GRAN, 0, 0, 0))


def read(cuda: CudaDevice, va: int, n: int) -> bytes:
    buf = (ctypes.c_char * n)()
    cuda.call("cuMemcpyDtoH", ctypes.addressof(buf), va, n)
    return bytes(buf)


# -- the fake's rules -----------------------------------------------------------------------------------------
def test_only_an_allocation_created_exportable_exports_and_only_as_a_descriptor(fake, cuda):
    kinds = fake.CUmemAllocationHandleType
    plain = int(cuda.call("cuMemCreate", GRAN, cuda.prop, 0))
    prop = exportable_prop(cuda)
    shared = int(cuda.call("cuMemCreate", GRAN, prop, 0))
    fd_kind = kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    assert fake.cuMemExportToShareableHandle(plain, fd_kind, 0)[0] == INVALID_VALUE
    assert fake.cuMemExportToShareableHandle(shared, kinds.CU_MEM_HANDLE_TYPE_FABRIC, 0)[0] == INVALID_VALUE
    assert fake.cuMemExportToShareableHandle(shared, fd_kind, 1)[0] == INVALID_VALUE        # flags are reserved
    assert fake.cuMemCreate(GRAN + 4096, prop, 0)[0] == INVALID_VALUE                     # the granularity holds
    prop.requestedHandleTypes = kinds.CU_MEM_HANDLE_TYPE_WIN32
    assert fake.cuMemCreate(GRAN, prop, 0)[0] == INVALID_VALUE
    err, fd = fake.cuMemExportToShareableHandle(shared, fd_kind, 0)
    assert err == OK
    assert fake.cuMemImportFromShareableHandle(fd, kinds.CU_MEM_HANDLE_TYPE_NONE)[0] == INVALID_VALUE
    os.close(fd)
    assert fake.cuMemImportFromShareableHandle(fd, fd_kind)[0] == INVALID_VALUE            # a closed descriptor
    for handle in (plain, shared):
        cuda.call("cuMemRelease", handle)


def test_a_shared_allocation_lives_until_every_handle_and_mapping_is_gone(fake, cuda):
    fd_kind = fake.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    made = int(cuda.call("cuMemCreate", GRAN, exportable_prop(cuda), 0))
    fd = int(cuda.call("cuMemExportToShareableHandle", made, fd_kind, 0))
    imported = int(cuda.call("cuMemImportFromShareableHandle", fd, fd_kind))
    os.close(fd)
    assert imported != made
    va = reserve(cuda, 1)
    cuda.call("cuMemMap", va, GRAN, 0, imported, 0)
    cuda.call("cuMemRelease", made)
    cuda.call("cuMemRelease", imported)
    assert fake.mem.live_allocations() == 1             # mapped: the memory stays
    cuda.call("cuMemUnmap", va, GRAN)
    assert fake.mem.live_allocations() == 0
    cuda.call("cuMemAddressFree", va, GRAN)


# -- chunks ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("total, chunk, page, match", [
    (4 * GRAN, 2 * GRAN, GRAN + 4096, "granularity"), (6 * GRAN, 3 * GRAN, 2 * GRAN, "multiple of the page size"),
    (5 * GRAN, 2 * GRAN, GRAN, "multiple of the chunk size"), (0, 2 * GRAN, GRAN, "pool size 0")])
def test_sizes_the_device_cannot_take_are_one_line_errors(cuda, total, chunk, page, match):
    with pytest.raises(LimitError, match=match) as e:
        CudaChunks.create(cuda, total, chunk, page)
    assert "\n" not in str(e.value)


def test_a_failed_creation_releases_the_chunks_made_before_it(fake, cuda):
    fake.fail("cuMemCreate", after=1)
    with pytest.raises(DriverError, match="cuMemCreate"):
        CudaChunks.create(cuda, 4 * GRAN, 2 * GRAN, GRAN)
    assert fake.handles == {}


def test_pages_written_in_one_member_are_read_in_another_and_zeroed_when_given(fake, cuda):
    """Two members with their own drivers (as two processes have): the creator exports, the joiner imports once
    per chunk and closes the descriptors; page 3 (chunk 1) maps at each member's own address, and what one writes
    the other reads; zeroed by its giver, the next owner reads zeros. Torn down, both drivers hold nothing."""
    made = CudaChunks.create(cuda, 4 * GRAN, 2 * GRAN, GRAN)
    other_fake = FakeCudaDriver(granularity=GRAN)
    other = CudaDevice(0, other_fake)
    fds = made.export()
    joined = CudaChunks.imported(other, fds, 2 * GRAN, GRAN)
    for fd in fds:
        os.close(fd)
    assert joined.total_pages == made.total_pages == 4 and made.where(3) == (made.handles[1], GRAN)
    va, other_va = reserve(cuda, 1), reserve(other, 1)
    made.map(va, 3)
    joined.map(other_va, 3)
    fake.write(va, PATTERN)
    assert read(other, other_va, GRAN) == PATTERN
    made.zero(va)
    assert read(other, other_va, GRAN) == bytes(GRAN)
    for chunks, device, at in ((made, cuda, va), (joined, other, other_va)):
        chunks.unmap(at)
        device.call("cuMemAddressFree", at, GRAN)
        chunks.close()
    other.release_primary(log_errors=False)
    assert other_fake.leaks() == {} and other_fake.mem.live_allocations() == 0


CHILD = """
import ctypes, sys
from kvlab.vmm.drivers.cuda_device import CudaDevice
from fakes.fake_cuda import FakeCudaDriver
from kvlab.vmm.pool.cuda_chunks import CudaChunks
GRAN = 2 << 20
cuda = CudaDevice(0, FakeCudaDriver(granularity=GRAN))
chunks = CudaChunks.imported(cuda, [int(fd) for fd in sys.argv[1:]], 2 * GRAN, GRAN)
va = int(cuda.call("cuMemAddressReserve", 2 * GRAN, 0, 0, 0))
chunks.map(va, 3)
chunks.map(va + GRAN, 0)
buf = (ctypes.c_char * 16)()
cuda.call("cuMemcpyDtoH", ctypes.addressof(buf), va, 16)
cuda.drv.write(va + GRAN, b"from the child")
chunks.unmap(va)
chunks.unmap(va + GRAN)
cuda.call("cuMemAddressFree", va, 2 * GRAN)
chunks.close()
print(bytes(buf).hex())
"""


def test_a_second_process_imports_the_chunks_and_shares_their_bytes(fake, cuda):
    made = CudaChunks.create(cuda, 4 * GRAN, 2 * GRAN, GRAN)
    va = reserve(cuda, 2)
    made.map(va, 3)
    fake.write(va, PATTERN[:16])
    fds = made.export()
    try:
        tests = os.path.dirname(os.path.abspath(__file__))   # the child imports the fake from tests/fakes
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
        child = subprocess.run([sys.executable, "-c", CHILD, *map(str, fds)], pass_fds=fds, capture_output=True,
                               text=True, timeout=120, env=env)
    finally:
        for fd in fds:
            os.close(fd)
    assert child.returncode == 0, child.stderr[-2000:]
    assert bytes.fromhex(child.stdout.strip()) == PATTERN[:16]          # the child read what this process wrote
    made.map(va + GRAN, 0)
    assert read(cuda, va + GRAN, 14) == b"from the child"                # and this process reads what it wrote
    for at in (va, va + GRAN):
        made.unmap(at)
    cuda.call("cuMemAddressFree", va, 2 * GRAN)
    made.close()


def dry_run(part: str, tmp_path) -> dict:
    """One part of the GPU check in its CPU dry run; its result, once it passed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "check.json"
    proc = subprocess.run(["bash", os.path.join(root, "experiments", "gpu_check.sh"), "--dry-run-cpu", "--parts",
                           part, "--out", str(out)], capture_output=True, text=True, timeout=300)
    got = json.loads(out.read_text())["parts"][part]
    assert proc.returncode == 0 and got["ok"], got
    return got["result"]


def test_the_gpu_checks_pool_part_passes_its_cpu_dry_run(tmp_path):
    """experiments/gpu/parts_pool.py: two processes on the fake device, as it runs on a lent GPU."""
    result = dry_run("cuda_pool", tmp_path)
    assert result["child"] == {"child_reads_parent_write": True, "reexport_of_import": "ok", "child_ok": True}
    assert result["parent_reads_child_write"] and result["fake_leaks"] == {}


@pytest.mark.slow     # ~16 s: two engines in two processes; test_pool_cuda_engine.py runs them on the fake driver
def test_the_gpu_checks_pool_engines_part_passes_its_cpu_dry_run(tmp_path):
    """experiments/gpu/parts_pool_engines.py on cpu over a host pool, as it runs on a lent GPU over a CUDA one."""
    result = dry_run("cuda_pool_engines", tmp_path)
    assert result["this_engine_equals_solo"] and result["child_equals_solo"] and result["pool_gone"]
    assert result["pool_block"]["pages_taken"] > 0 and result["child"]["pool_block"]["pages_taken"] > 0
