"""A window of reserved addresses into which the pool tests map pool pages MAP_FIXED|MAP_SHARED by offset, as the
vmm host driver maps its own: a bare engine's mappings, without a vmm cache."""
from __future__ import annotations

import ctypes

from kvlab.vmm.libc import LIBC, MAP_FAILED, MAP_FIXED, MAP_SHARED, PROT_NONE, PROT_RW, RESERVED
from kvlab.vmm.pool.errors import PoolError
from kvlab.vmm.pool.memory import failed


class PageWindow:
    """`slots` page-sized slots of reserved addresses; `map(slot, fd, offset)` puts a pool page there."""

    def __init__(self, page_size: int, slots: int) -> None:
        self.page_size, self.slots = page_size, slots
        self.base = LIBC.mmap(None, page_size * slots, PROT_NONE, RESERVED, -1, 0)
        if self.base in (MAP_FAILED, None):
            raise failed(f"reserving {slots} pages of addresses")

    def address(self, slot: int) -> int:
        if self.base is None or not 0 <= slot < self.slots:
            raise PoolError(f"slot {slot} is outside the window's {self.slots} slots (or the window is closed)")
        return self.base + slot * self.page_size

    def _remap(self, slot: int, prot: int, flags: int, fd: int, offset: int) -> None:
        addr = self.address(slot)
        if LIBC.mmap(addr, self.page_size, prot, flags | MAP_FIXED, fd, offset) != addr:
            raise failed(f"mapping slot {slot}")

    def map(self, slot: int, fd: int, offset: int) -> None:
        self._remap(slot, PROT_RW, MAP_SHARED, fd, offset)

    def unmap(self, slot: int) -> None:
        """Back to reserved addresses; touching the slot now faults."""
        self._remap(slot, PROT_NONE, RESERVED, -1, 0)

    def view(self, slot: int) -> memoryview:
        """The mapped page's bytes (valid until the slot is unmapped)."""
        return memoryview((ctypes.c_uint8 * self.page_size).from_address(self.address(slot))).cast("B")

    def close(self) -> None:
        if self.base is not None:
            LIBC.munmap(self.base, self.page_size * self.slots)
            self.base = None
