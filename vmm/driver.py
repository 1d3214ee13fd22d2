"""The virtual-memory seam: reserve address space, map physical pool pages into it, view it as a tensor.

`VirtualMemory` keeps every piece of bookkeeping (what is mapped where, mapping counts, limits, timings) and
validates each request before the OS/driver sees it; subclasses only make the real calls:
vmm/host.py (mmap + memfd), vmm/cuda.py (CUDA VMM driver API) and `AccountingVirtualMemory` below (no memory,
the simulator's mode). Not thread-safe: the cache serialises every call under its lock.
"""
from __future__ import annotations

import gc
import time
import weakref
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from common.errors import DriverError


@dataclass(slots=True)
class Region:
    """A reserved virtual range. `mapped` holds the pool page mapped at each mapped VA page index."""
    base: int
    nbytes: int
    mapped: dict[int, int] = field(default_factory=dict)
    segments: int = 1            # OS mappings of this range (host: VMAs incl. PROT_NONE gaps; cuda: mapped pages)
    live_views: int = 0          # tensor views still alive (weakref.finalize on what each view keeps alive)
    released: bool = False
    orphan_release: Callable[[Region], None] | None = None   # set when its driver died first


@dataclass(slots=True)
class DriverStats:
    reserved_bytes: int = 0
    pool_pages: int = 0
    mapped_pages: int = 0        # VA pages currently mapped (a shared pool page counts once per mapping)
    num_mappings: int = 0        # host: VMAs of our ranges; cuda: cuMemMap mappings
    map_calls: int = 0           # OS/driver calls made to map
    unmap_calls: int = 0
    map_seconds: float = 0.0
    unmap_seconds: float = 0.0
    pages_mapped: int = 0        # cumulative pages mapped / unmapped (per-page cost = seconds / pages)
    pages_unmapped: int = 0
    discarded_pages: int = 0     # pool pages whose memory was given back


class VirtualMemory(ABC):
    """Reserve -> create pool -> map/unmap pool pages at page-aligned offsets -> tensor views -> release/close.

    `merges`: whether neighbouring mappings of consecutive pool pages coalesce into one OS mapping (Linux VMAs
    do; CUDA mappings do not). `mapping_limit`: the most mappings this driver may create (None: no limit)."""

    name = "abstract"
    merges = True

    def __init__(self, page_size: int, mapping_limit: int | None = None) -> None:
        self.page_size = page_size
        self.mapping_limit = mapping_limit
        self.stats = DriverStats()
        self.regions: list[Region] = []
        self.pool_maps = array("i")          # VA mappings of each pool page
        self.closed = False

    # -- what subclasses implement ------------------------------------------------------------------------
    @abstractmethod
    def granularity(self) -> int:
        """The smallest page size the OS/driver allows; page_size is a multiple of it."""

    @abstractmethod
    def _os_reserve(self, nbytes: int) -> int: ...

    @abstractmethod
    def _os_release(self, region: Region) -> None: ...

    @abstractmethod
    def _os_resize_pool(self, old_pages: int, new_pages: int) -> None: ...

    @abstractmethod
    def _os_map(self, addr: int, first_page: int, num_pages: int) -> int:
        """Map pool pages [first_page, +num_pages) at addr; returns the number of OS calls made."""

    @abstractmethod
    def _os_unmap(self, addr: int, num_pages: int) -> int:
        """Unmap num_pages pages at addr, leaving the range reserved; returns the number of OS calls made."""

    @abstractmethod
    def _os_discard(self, first_page: int, num_pages: int) -> None: ...

    @abstractmethod
    def _os_view(self, region: Region, offset: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A zero-copy uint8 tensor over [base + offset, +nbytes) and the object whose life tracks the view."""

    @abstractmethod
    def _os_close(self) -> None: ...

    # -- the seam -----------------------------------------------------------------------------------------
    def round_up(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size) * self.page_size

    def reserve(self, nbytes: int) -> Region:
        """Reserve virtual address space (rounded up to whole pages); no physical memory."""
        self._check_open()
        nbytes = self.round_up(max(nbytes, 1))
        self._check_mapping_limit(1, "reserve")
        region = Region(self._os_reserve(nbytes), nbytes, segments=1 if self.merges else 0)
        self.regions.append(region)
        self.stats.reserved_bytes += nbytes
        self.stats.num_mappings += region.segments
        return region

    def create_pool(self, num_pages: int) -> None:
        """Create (or resize) the physical page pool: pages 0 .. num_pages-1."""
        self.resize_pool(num_pages)

    def resize_pool(self, num_pages: int) -> None:
        """Grow the pool, or shrink it and give the cut pages' memory back (they must be unmapped)."""
        self._check_open()
        old = len(self.pool_maps)
        if num_pages < old and any(self.pool_maps[num_pages:]):
            raise DriverError(f"cannot shrink the page pool to {num_pages} pages: pages above it are still mapped")
        self._os_resize_pool(old, num_pages)
        if num_pages > old:
            self.pool_maps.extend([0] * (num_pages - old))
        else:
            del self.pool_maps[num_pages:]
            self.stats.discarded_pages += old - num_pages
        self.stats.pool_pages = num_pages

    def map(self, region: Region, offset: int, page: int, num_pages: int = 1) -> None:
        """Map pool pages [page, page + num_pages) at region offset `offset` (read-write)."""
        self._check_open()
        first = self._va_page(region, offset, num_pages)
        if page < 0 or page + num_pages > len(self.pool_maps):
            raise DriverError(f"pool pages [{page}, {page + num_pages}) are outside the pool of "
                              f"{len(self.pool_maps)} pages")
        clash = [i for i in range(first, first + num_pages) if i in region.mapped]
        if clash:
            raise DriverError(f"VA page {clash[0]} of the range at {region.base:#x} is already mapped; unmap it first")
        change = {first + i: page + i for i in range(num_pages)}
        delta = self._segment_delta(region, change)
        self._check_mapping_limit(delta, "map")
        t0 = time.perf_counter()
        calls = self._os_map(region.base + offset, page, num_pages)
        self.stats.map_seconds += time.perf_counter() - t0
        self.stats.map_calls += calls
        self.stats.pages_mapped += num_pages
        region.mapped.update(change)
        for p in change.values():
            self.pool_maps[p] += 1
        self._add_segments(region, delta)
        self.stats.mapped_pages += num_pages

    def unmap(self, region: Region, offset: int, num_pages: int = 1) -> None:
        """Unmap [offset, + num_pages pages): the range stays reserved, the pool pages stay allocated."""
        self._check_open()
        first = self._va_page(region, offset, num_pages)
        missing = [i for i in range(first, first + num_pages) if i not in region.mapped]
        if missing:
            raise DriverError(f"VA page {missing[0]} of the range at {region.base:#x} is not mapped")
        change = {first + i: None for i in range(num_pages)}
        delta = self._segment_delta(region, change)
        self._check_mapping_limit(delta, "unmap")   # splitting a merged mapping adds VMAs
        t0 = time.perf_counter()
        calls = self._os_unmap(region.base + offset, num_pages)
        self.stats.unmap_seconds += time.perf_counter() - t0
        self.stats.unmap_calls += calls
        self.stats.pages_unmapped += num_pages
        for i in change:
            self.pool_maps[region.mapped.pop(i)] -= 1
        self._add_segments(region, delta)
        self.stats.mapped_pages -= num_pages

    def discard(self, page: int, num_pages: int = 1) -> None:
        """Give the memory of unmapped pool pages back to the OS/driver; they read as zeros when mapped again."""
        self._check_open()
        if any(self.pool_maps[page:page + num_pages]):
            raise DriverError(f"cannot discard pool pages [{page}, {page + num_pages}): some are mapped")
        self._os_discard(page, num_pages)
        self.stats.discarded_pages += num_pages

    def release(self, region: Region) -> None:
        """Unmap what is still mapped and free the reservation. Refused while a tensor view of it is alive."""
        if region.released:
            return
        live = self.live_views(region)
        if live:
            raise DriverError(f"{live} tensor view(s) of the range at {region.base:#x} are still alive; "
                              "drop every view before releasing it")
        for start, count in runs(sorted(region.mapped)):
            self.unmap(region, start * self.page_size, count)
        self._os_release(region)
        region.released = True
        self.regions.remove(region)
        self.stats.reserved_bytes -= region.nbytes
        self.stats.num_mappings -= region.segments

    def tensor_view(self, region: Region, dtype: torch.dtype, shape: tuple[int, ...],
                    strides: tuple[int, ...] | None = None, offset: int = 0) -> torch.Tensor:
        """A zero-copy tensor over the range (never reads memory). `strides` in elements, default contiguous;
        `offset` in bytes from the start of the range."""
        self._check_open()
        itemsize = torch.empty((), dtype=dtype).element_size()
        strides = strides or contiguous_strides(shape)
        span = itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, strides))) if all(shape) else 0
        if offset % itemsize or offset < 0 or offset + span > region.nbytes:
            raise DriverError(f"a view of {span} bytes at offset {offset} does not fit the {region.nbytes}-byte "
                              f"range at {region.base:#x}")
        raw, holder = self._os_view(region, offset, region.nbytes - offset)
        region.live_views += 1
        weakref.finalize(holder, _view_dropped, region)
        return raw.view(dtype).as_strided(shape, strides)

    def live_views(self, region: Region | None = None) -> int:
        def count() -> int:
            return sum(r.live_views for r in self.regions if region is None or r is region)
        if count():
            gc.collect()   # views kept only by reference cycles must not block a release
        return count()

    def close(self) -> None:
        """Release every range and the pool. Idempotent; refused (nothing released) while views are alive."""
        if self.closed:
            return
        live = self.live_views()
        if live:
            raise DriverError(f"{live} tensor view(s) are still alive; drop them before closing the driver")
        errors = []
        for region in list(self.regions):
            try:
                self.release(region)
            except DriverError as exc:  # keep releasing the rest, then report the first failure
                errors.append(exc)
        try:
            self._os_close()
        except DriverError as exc:
            errors.append(exc)
        self.closed = True
        if errors:
            raise errors[0]

    # -- helpers ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise DriverError(f"the {self.name} virtual-memory driver is closed")

    def _va_page(self, region: Region, offset: int, num_pages: int) -> int:
        if region.released:
            raise DriverError(f"the range at {region.base:#x} was released")
        if offset % self.page_size or num_pages < 1 or offset < 0 \
                or offset + num_pages * self.page_size > region.nbytes:
            raise DriverError(f"offset {offset} (+{num_pages} pages of {self.page_size} B) is not page-aligned "
                              f"inside the {region.nbytes}-byte range at {region.base:#x}")
        return offset // self.page_size

    def _segment_delta(self, region: Region, change: dict[int, int | None]) -> int:
        """How many OS mappings `change` (VA page -> pool page or None) adds to the region."""
        if not self.merges:
            return sum(1 if p is not None else -1 for p in change.values())
        last = region.nbytes // self.page_size - 1
        edges = {e for i in change for e in (i, i + 1) if 1 <= e <= last}

        def state(i: int, after: bool) -> int | None:
            return change[i] if after and i in change else region.mapped.get(i)

        def boundary(e: int, after: bool) -> bool:
            a, b = state(e - 1, after), state(e, after)
            if a is None or b is None:
                return a is not b
            return b != a + 1
        return sum(boundary(e, True) - boundary(e, False) for e in edges)

    def _add_segments(self, region: Region, delta: int) -> None:
        region.segments += delta
        self.stats.num_mappings += delta

    def _check_mapping_limit(self, delta: int, call: str) -> None:
        if self.mapping_limit is not None and delta > 0 and self.stats.num_mappings + delta > self.mapping_limit:
            raise DriverError(f"{call} would need {self.stats.num_mappings + delta} mappings, above this process's "
                              f"budget of {self.mapping_limit} (vm.max_map_count); use a larger page_size or fewer "
                              "scattered pages")


class AccountingVirtualMemory(VirtualMemory):
    """Same bookkeeping, no memory: addresses are invented, maps cost nothing, views are refused."""

    name = "accounting"

    def __init__(self, page_size: int, merges: bool = True, mapping_limit: int | None = None) -> None:
        super().__init__(page_size, mapping_limit)
        self.merges = merges
        self._next_base = 1 << 40

    def granularity(self) -> int:
        return self.page_size

    def _os_reserve(self, nbytes: int) -> int:
        base, self._next_base = self._next_base, self._next_base + nbytes + self.page_size
        return base

    def _os_release(self, region: Region) -> None:
        pass

    def _os_resize_pool(self, old_pages: int, new_pages: int) -> None:
        pass

    def _os_map(self, addr: int, first_page: int, num_pages: int) -> int:
        return 1

    def _os_unmap(self, addr: int, num_pages: int) -> int:
        return 1

    def _os_discard(self, first_page: int, num_pages: int) -> None:
        pass

    def _os_view(self, region: Region, offset: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        raise DriverError("the accounting-only driver has no memory to view; use a real device driver")

    def _os_close(self) -> None:
        pass


def _view_dropped(region: Region) -> None:
    region.live_views -= 1
    if region.live_views == 0 and region.orphan_release is not None:
        region.orphan_release(region)
        region.orphan_release = None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices -> (start, length) runs of consecutive values."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
