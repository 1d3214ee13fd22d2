"""The three parts the fake CUDA driver (fake_cuda.py) is composed of: the call log with injected failures, the
contexts (init, primary contexts, the current one per thread, pending work), and the device memory (reservations,
physical allocations and the handles to them, mappings and their bytes).

An allocation made with requestedHandleTypes POSIX_FILE_DESCRIPTOR keeps its bytes in a memfd, so it can be
exported as a file descriptor and imported by another process's fake (or this one's), each import a new handle
to the same bytes; its memory is released only when every handle to it is released and nothing maps it."""
from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass
from typing import Any

from cuda.bindings import driver as _real

CUresult = _real.CUresult
CUmemAllocationType = _real.CUmemAllocationType
CUmemLocationType = _real.CUmemLocationType
CUmemAllocationHandleType = _real.CUmemAllocationHandleType
POSIX_FD = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
NO_HANDLE_TYPE = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
NOT_INITIALIZED = CUresult.CUDA_ERROR_NOT_INITIALIZED
INVALID_CONTEXT = CUresult.CUDA_ERROR_INVALID_CONTEXT
INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE


@dataclass
class Failure:
    name: str
    after: int                  # let this many matching calls succeed first
    result: Any = None          # a CUresult to return ...
    exc: BaseException | None = None   # ... or an exception to raise


@dataclass
class Mapping:
    size: int
    handle: int
    accessible: bool = False
    offset: int = 0             # into the handle's allocation


@dataclass
class Allocation:
    """Physical memory; `fd`: the memfd holding its bytes when it is exportable (else None: `DeviceMemory.memory`)."""
    size: int
    fd: int | None = None
    handles: int = 0            # live handles to it in this process

    def key(self) -> tuple[int, int] | None:
        if self.fd is None:
            return None
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino


class CallLog:
    """`calls` records (name, thread id) in order; `fail` injects a CUresult or an exception into a later call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.failures: list[Failure] = []

    def fail(self, name: str, result: Any = INVALID_VALUE, after: int = 0, exc: BaseException | None = None) -> None:
        """Make the (after+1)-th next call of `name` fail with `result` (or raise `exc`)."""
        self.failures.append(Failure(name, after, result, exc))

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def enter(self, name: str) -> Any:
        """Record a call; an injected failure's result tuple (or its exception), else None."""
        self.calls.append((name, threading.get_ident()))
        for f in self.failures:
            if f.name == name:
                if f.after:
                    f.after -= 1
                    return None
                self.failures.remove(f)
                if f.exc is not None:
                    raise f.exc
                return (f.result,)
        return None


class Contexts:
    def __init__(self) -> None:
        self.initialized = False
        self.primary_retains: dict[int, int] = {}
        self.current: dict[int, int] = {}               # thread id -> context (0 = none)
        self.work_pending = False                       # access granted / kernel launched since last sync

    @staticmethod
    def primary_context(dev: int) -> int:
        return 0x1000 + dev

    def launch(self) -> None:
        """Pretend a kernel was launched that may read mapped memory."""
        self.work_pending = True

    def need_context(self) -> CUresult | None:
        if not self.initialized:
            return NOT_INITIALIZED
        if not self.current.get(threading.get_ident()):
            return INVALID_CONTEXT
        return None

    def is_retained(self, ctx: int) -> bool:
        return any(self.primary_context(d) == ctx and n for d, n in self.primary_retains.items())


class DeviceMemory:
    def __init__(self, granularity: int, num_devices: int, memory_bytes: int) -> None:
        self.granularity, self.num_devices, self.memory_bytes = granularity, num_devices, memory_bytes
        self.reservations: dict[int, int] = {}          # ptr -> size
        self.handles: dict[int, int] = {}               # live handle -> size
        self.mappings: dict[int, Mapping] = {}          # mapped ptr -> mapping
        self.memory: dict[int, bytearray] = {}          # handle -> its bytes, garbage until written (made on read)
        self.alloc_of: dict[int, Allocation] = {}       # handle (live, or released but still mapped) -> allocation
        self._next_ptr = 0x7F00_0000_0000
        self._next_handle = 1
        self._lock = threading.Lock()

    def aligned(self, *values: int) -> bool:
        return all(int(v) % self.granularity == 0 for v in values)

    def valid_prop(self, prop: Any) -> bool:
        return (prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                and prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                and 0 <= prop.location.id < self.num_devices
                and prop.requestedHandleTypes in (NO_HANDLE_TYPE, POSIX_FD))   # no fabric or Windows handles here

    def allocated_bytes(self) -> int:
        """Device memory held by this process's allocations (an import of another process's counts there)."""
        return sum(a.size for a in {id(a): a for a in self.alloc_of.values() if a.handles}.values())

    def reservation_of(self, ptr: int, size: int) -> int | None:
        for base, n in self.reservations.items():
            if base <= ptr and ptr + size <= base + n:
                return base
        return None

    def mapped_in(self, ptr: int, size: int) -> list[int]:
        return [p for p, m in self.mappings.items() if p < ptr + size and ptr < p + m.size]

    def reserve(self, size: int) -> int:
        with self._lock:
            ptr = self._next_ptr
            self._next_ptr += size + self.granularity
            self.reservations[ptr] = size
        return ptr

    def create(self, size: int, exportable: bool = False) -> int:
        """A new allocation and its first handle; not zeroed: its bytes are garbage (`read`)."""
        fd = None
        if exportable:
            fd = os.memfd_create("fake-cuda-allocation", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            garbage = random.Random(fd * 7919 + size).randbytes(min(size, 1 << 16))
            for offset in range(0, size, len(garbage)):
                os.pwrite(fd, garbage, offset)
        return self.add_handle(Allocation(size, fd))

    def add_handle(self, alloc: Allocation) -> int:
        h, self._next_handle = self._next_handle, self._next_handle + 1
        self.handles[h] = alloc.size
        self.alloc_of[h] = alloc
        alloc.handles += 1
        return h

    def import_fd(self, fd: int) -> int:
        """A new handle to the allocation behind an exported descriptor (this process's, or another's)."""
        st = os.fstat(fd)
        mine = next((a for a in self.alloc_of.values() if a.handles and a.key() == (st.st_dev, st.st_ino)), None)
        return self.add_handle(mine or Allocation(st.st_size, os.dup(fd)))

    def release(self, h: int) -> None:
        """The handle is gone; its allocation's memory too once no handle nor mapping is left."""
        del self.handles[h]
        self.alloc_of[h].handles -= 1
        self._free_if_unused(h)

    def unmapped(self, h: int) -> None:
        self._free_if_unused(h)

    def _free_if_unused(self, h: int) -> None:
        alloc = self.alloc_of[h]
        if h in self.handles or any(m.handle == h for m in self.mappings.values()):
            return
        del self.alloc_of[h]
        self.memory.pop(h, None)
        if not alloc.handles and not any(self.alloc_of.get(m.handle) is alloc for m in self.mappings.values()) \
                and alloc.fd is not None:
            os.close(alloc.fd)
            alloc.fd = None

    def live_allocations(self) -> int:
        return len({id(a) for a in self.alloc_of.values()})

    def _locate(self, ptr: int, n: int) -> tuple[Mapping, int]:
        base = next((p for p, m in self.mappings.items() if p <= ptr and ptr + n <= p + m.size), None)
        if base is None:
            raise AssertionError(f"access of {n} bytes at {ptr:#x}: not inside one mapping (the device would fault)")
        mapping = self.mappings[base]
        return mapping, mapping.offset + ptr - base

    def write(self, ptr: int, data: bytes) -> None:
        """What a kernel writing mapped memory does."""
        mapping, at = self._locate(ptr, len(data))
        alloc = self.alloc_of[mapping.handle]
        if alloc.fd is not None:
            os.pwrite(alloc.fd, data, at)
            return
        self.read(ptr, len(data))        # makes the garbage
        self.memory[mapping.handle][at:at + len(data)] = data

    def read(self, ptr: int, n: int) -> bytes:
        """The n bytes a mapped address holds (within one mapping): garbage until something writes them."""
        mapping, at = self._locate(ptr, n)
        alloc = self.alloc_of[mapping.handle]
        if alloc.fd is not None:
            return os.pread(alloc.fd, n, at)
        data = self.memory.setdefault(mapping.handle, bytearray(random.Random(mapping.handle).randbytes(alloc.size)))
        return bytes(data[at:at + n])
