"""Real virtual memory on the host (Linux mmap over a memfd): the CPU analog of CUDA VMM.

reserve  = mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)      (cuMemAddressReserve)
store    = one memfd named "kvlab-kv", page i at file offset i * page,    (cuMemCreate handles)
           its pages faulted in (zero-filled) when the store is created or grown
map      = mmap(PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, memfd, i * page)   (cuMemMap + cuMemSetAccess)
unmap    = the same range remapped PROT_NONE (stays reserved)              (cuMemUnmap)
discard  = fallocate(PUNCH_HOLE|KEEP_SIZE): the store gives memory back     (cuMemRelease)
view     = torch.frombuffer over the address: zero-copy, never reads memory
Linux counts every VMA against vm.max_map_count; neighbours mapping consecutive memfd offsets merge into one,
and every host driver of the process draws on one map budget (vmm/drivers/map_budget.py): a map past it is
refused (MapBudgetExhausted, out of room like out of KV) before the kernel would fail it.
A map or unmap is one mmap call, so a failure means no page changed; release is one munmap of the whole range,
which also drops whatever an earlier failed unmap left mapped.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.map_budget import MapBudget, max_map_count, process_budget
from kvlab.vmm.drivers.types import DriverStats, Region
from kvlab.vmm.libc import (
    LIBC,
    MAP_FAILED,
    MAP_FIXED,
    MAP_POPULATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_RW,
    PUNCH_HOLE,
    RESERVED,
)

__all__ = ["DEFAULT_PAGE_SIZE", "POOL_NAME", "HostMemory", "HostVirtualMemory",
           "max_map_count"]   # max_map_count: map_budget.py

POOL_NAME = "kvlab-kv"
DEFAULT_PAGE_SIZE = 64 * 1024


class HostMemory:
    """The host's OS calls (`OSMemory`). `populate`: the store's memory is allocated when the store is created or
    grown, as the CUDA driver's cuMemCreate handles are (and vAttention creates its whole physical pool up front),
    not zero-filled by a map on the step; a map fills its page tables (MAP_POPULATE), so no first access faults.
    False: both on first touch. `collected`: what releases the memory if the driver is collected unclosed."""

    name = "host"
    merges = True
    unmaps_runs = True

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE, populate: bool = True) -> None:
        if not sys.platform.startswith("linux"):
            raise DriverError(f"the host VMM driver needs Linux (memfd, MAP_FIXED); this is {sys.platform}")
        if page_size <= 0 or page_size % mmap.PAGESIZE:
            raise DriverError(f"page_size {page_size} is not a positive multiple of the OS page ({mmap.PAGESIZE})")
        self.page_size, self.populate = page_size, populate
        self.libc = LIBC
        self.fd = os.memfd_create(POOL_NAME, os.MFD_CLOEXEC)
        self._file_pages = 0
        self.collected: weakref.finalize | None = None

    def granularity(self) -> int:
        return mmap.PAGESIZE

    def page_offset(self, page: int) -> int:
        """Byte offset of store page `page` in the memfd (for independent reads of the store)."""
        return page * self.page_size

    def mmap_at(self, what: str, addr: int | None, nbytes: int, prot: int, flags: int, fd: int, offset: int) -> int:
        got = self.libc.mmap(addr, nbytes, prot, flags, fd, offset)
        if got == MAP_FAILED or got is None:
            err = ctypes.get_errno()
            raise DriverError(f"mmap ({what}) of {nbytes} bytes failed: {os.strerror(err)} (errno {err})")
        if addr is not None and got != addr:
            raise DriverError(f"mmap ({what}) returned {got:#x} instead of the fixed address {addr:#x}")
        return got

    def reserve(self, nbytes: int) -> int:
        return self.mmap_at("reserve", None, nbytes, PROT_NONE, RESERVED, -1, 0)

    def release(self, region: Region) -> None:
        self.munmap_at(f"the range at {region.base:#x}", region.base, region.nbytes)

    def munmap_at(self, what: str, addr: int, nbytes: int) -> None:
        if self.libc.munmap(addr, nbytes) != 0:
            err = ctypes.get_errno()
            raise DriverError(f"munmap of {what} failed: {os.strerror(err)}")

    def resize_store(self, old_pages: int, new_pages: int) -> None:
        if new_pages > self._file_pages:
            os.ftruncate(self.fd, new_pages * self.page_size)
            self._file_pages = new_pages
        elif new_pages < old_pages:
            self.discard(new_pages, old_pages - new_pages)
        if self.populate and new_pages > old_pages:
            self.fault_in(old_pages, new_pages - old_pages)

    def fault_in(self, first_page: int, num_pages: int) -> None:
        """Allocate (zero-fill) store pages [first_page, + num_pages) through one passing mapping of them."""
        nbytes = num_pages * self.page_size
        addr = self.mmap_at("fault in store pages", None, nbytes, PROT_RW, MAP_SHARED | MAP_POPULATE, self.fd,
                            first_page * self.page_size)
        self.munmap_at("the passing mapping of store pages", addr, nbytes)

    def map(self, addr: int, first_page: int, num_pages: int) -> int:
        flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if self.populate else 0)
        self.mmap_at("map store pages", addr, num_pages * self.page_size, PROT_RW, flags, self.fd,
                   first_page * self.page_size)
        return 1

    def unmap(self, addr: int, num_pages: int) -> int:
        self.mmap_at("unmap to PROT_NONE", addr, num_pages * self.page_size, PROT_NONE, RESERVED | MAP_FIXED, -1, 0)
        return 1

    def discard(self, first_page: int, num_pages: int) -> None:
        if self.libc.fallocate(self.fd, PUNCH_HOLE, first_page * self.page_size, num_pages * self.page_size) != 0:
            err = ctypes.get_errno()
            raise DriverError(f"fallocate(PUNCH_HOLE) of store pages [{first_page}, +{num_pages}) failed: "
                              f"{os.strerror(err)}")

    def view(self, region: Region, offset: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        buffer = (ctypes.c_uint8 * nbytes).from_address(region.base + offset)
        return torch.frombuffer(buffer, dtype=torch.uint8), buffer   # the tensor keeps `buffer` alive

    def close(self, store_maps: Sequence[int]) -> None:
        if self.collected is not None:
            self.collected.detach()
        os.close(self.fd)


class HostVirtualMemory(VirtualMemory):
    """Virtual memory over `HostMemory` (built from `page_size` and `populate` unless given as `memory`).
    `budget`: the map budget to draw on, by default the one this process's host drivers share; `mapping_limit`:
    a limit of this driver's own on top of it (tests)."""

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE, populate: bool = True, mapping_limit: int | None = None,
                 budget: MapBudget | None = None, memory: HostMemory | None = None) -> None:
        memory = memory or HostMemory(page_size, populate)
        super().__init__(memory, memory.page_size, mapping_limit, process_budget() if budget is None else budget)
        memory.collected = weakref.finalize(self, _release_unclosed, memory.libc, memory.fd, self.regions,
                                            self.budget, self.stats)


def _release_unclosed(libc: ctypes.CDLL, fd: int, regions: list[Region], budget: MapBudget,
                      stats: DriverStats) -> None:
    """A driver collected without close(): give back the page store now and each range when its last view goes (the
    budget gets its mappings back at once)."""
    budget.add(-stats.num_mappings)
    def unmap(region: Region) -> None:
        libc.munmap(region.base, region.nbytes)
    for region in regions:
        if region.live_views:
            region.orphan_release = unmap
        else:
            unmap(region)
    os.close(fd)   # mappings still in use keep the memfd's pages
