"""The three parts the fake CUDA driver (fake_cuda.py) is composed of: the call log with injected failures, the
contexts (init, primary contexts, the current one per thread, pending work), and the device memory (reservations,
physical handles, mappings and their bytes)."""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any

from cuda.bindings import driver as _real

CUresult = _real.CUresult
CUmemAllocationType = _real.CUmemAllocationType
CUmemLocationType = _real.CUmemLocationType
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
        self._next_ptr = 0x7F00_0000_0000
        self._next_handle = 1
        self._lock = threading.Lock()

    def aligned(self, *values: int) -> bool:
        return all(int(v) % self.granularity == 0 for v in values)

    def valid_prop(self, prop: Any) -> bool:
        return (prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                and prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                and 0 <= prop.location.id < self.num_devices)

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

    def create(self, size: int) -> int:
        h, self._next_handle = self._next_handle, self._next_handle + 1
        self.handles[h] = size   # not zeroed: its bytes are garbage (`read`)
        return h

    def read(self, ptr: int, n: int) -> bytes:
        """The n bytes a mapped address holds (within one mapping): garbage until something writes them."""
        base = next((p for p, m in self.mappings.items() if p <= ptr and ptr + n <= p + m.size), None)
        if base is None:
            raise AssertionError(f"read of {n} bytes at {ptr:#x}: not inside one mapping (the device would fault)")
        mapping = self.mappings[base]
        data = self.memory.setdefault(mapping.handle, bytearray(random.Random(mapping.handle).randbytes(mapping.size)))
        return bytes(data[ptr - base:ptr - base + n])
