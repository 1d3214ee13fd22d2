"""The host memory calls of a pool (cpu-facts.md §6): punch pages' memory back to the OS, and a window of reserved
addresses into which pool pages are mapped MAP_FIXED|MAP_SHARED by offset, as the vmm host driver maps its own."""
from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Iterator

from kvlab.vmm.libc import LIBC, MAP_FAILED, MAP_FIXED, MAP_SHARED, PROT_NONE, PROT_RW, PUNCH_HOLE, RESERVED
from kvlab.vmm.pool.errors import PoolError


def _failed(what: str) -> PoolError:
    err = ctypes.get_errno()
    return PoolError(f"{what} failed: {os.strerror(err)} (errno {err})")


def runs(pages: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Sorted page ids as (first, count) runs of consecutive ids."""
    first = count = None
    for page in sorted(pages):
        if first is not None and page == first + count:
            count += 1
            continue
        if first is not None:
            yield first, count
        first, count = page, 1
    if first is not None:
        yield first, count


def punch(fd: int, page_size: int, pages: Iterable[int]) -> None:
    """Give the pages' memory back to the OS; the next reader of them sees zeros."""
    for first, count in runs(pages):
        if LIBC.fallocate(fd, PUNCH_HOLE, first * page_size, count * page_size) != 0:
            raise _failed(f"punching {count} pool pages at page {first}")


class PageWindow:
    """`slots` page-sized slots of reserved addresses; `map(slot, fd, offset)` puts a pool page there."""

    def __init__(self, page_size: int, slots: int) -> None:
        self.page_size, self.slots = page_size, slots
        self.base = LIBC.mmap(None, page_size * slots, PROT_NONE, RESERVED, -1, 0)
        if self.base in (MAP_FAILED, None):
            raise _failed(f"reserving {slots} pages of addresses")

    def address(self, slot: int) -> int:
        if self.base is None or not 0 <= slot < self.slots:
            raise PoolError(f"slot {slot} is outside the window's {self.slots} slots (or the window is closed)")
        return self.base + slot * self.page_size

    def _remap(self, slot: int, prot: int, flags: int, fd: int, offset: int) -> None:
        addr = self.address(slot)
        if LIBC.mmap(addr, self.page_size, prot, flags | MAP_FIXED, fd, offset) != addr:
            raise _failed(f"mapping slot {slot}")

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
