"""The virtual-memory seam: reserve address space, map physical pool pages into it, view it as a tensor.

`VirtualMemory` keeps every piece of bookkeeping (what is mapped where, mapping counts, limits, timings) and
validates each request before the OS/driver sees it; subclasses only make the real calls:
vmm/drivers/host.py (mmap + memfd), vmm/drivers/cuda.py (CUDA VMM driver API) and vmm/drivers/accounting.py (no
memory, the simulator's mode). Places always mapped in lockstep (the cache's 2L tensors) are mapped with one
`map_mirrored` call; a composed `MirrorRepair` (vmm/drivers/mirror.py) undoes a failed one, and a composed
`Teardown` (vmm/drivers/teardown.py) does `release`/`close`. Not thread-safe: the cache serialises every call
under its lock.

When a call fails the books still say exactly what is mapped: `map`/`unmap` book the pages an OS call got through
before failing (`PartialCall`), the mirrored calls undo the places already done (all or nothing), and `release`/
`close` try every unmap and free every range even when some fail, then raise one `DriverError` that sums up.
"""
from __future__ import annotations

import gc
import time
import weakref
from abc import ABC, abstractmethod
from array import array
from itertools import pairwise
from typing import Any

import torch

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.map_budget import MapBudget, MapBudgetExhausted
from kvlab.vmm.drivers.mirror import MirrorRepair
from kvlab.vmm.drivers.teardown import Teardown
from kvlab.vmm.drivers.types import DriverStats, Mirror, PartialCall, Region
from kvlab.vmm.drivers.vmas import map_delta, unmap_delta

__all__ = ["DriverStats", "Mirror", "PartialCall", "Region", "VirtualMemory"]


class VirtualMemory(ABC):
    """Reserve -> create pool -> map/unmap pool pages at page-aligned offsets -> tensor views -> release/close.

    `merges`: whether neighbouring mappings of consecutive pool pages coalesce into one OS mapping (Linux VMAs
    do; CUDA mappings do not). `mapping_limit`: the most mappings this driver may create (None: no limit).
    `budget`: the process-wide map budget this driver draws on with every other (vmm/drivers/map_budget.py).

    38 methods, on purpose: 9 are the OS seam each driver implements (`granularity`, `_os_*`); the public
    calls all read and write the same books (page tables, pool map counts, stats) and check every request against
    them before the OS sees it, so splitting them would only make those books public. Repairs after a failed
    mirrored call and teardown are composed parts (`repair`, `teardown`)."""

    name = "abstract"
    merges = True

    def __init__(self, page_size: int, mapping_limit: int | None = None, budget: MapBudget | None = None) -> None:
        self.page_size = page_size
        self.mapping_limit = mapping_limit
        self.budget = budget
        self.stats = DriverStats()
        self.regions: list[Region] = []
        self.pool_maps = array("i")          # VA mappings of each pool page
        self.closed = False
        self.repair = MirrorRepair(self)
        self.teardown = Teardown(self)

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
        """Map pool pages [first_page, +num_pages) at addr; returns the number of OS calls made. On failure undo
        what it can: raise `PartialCall` if the first pages stay mapped, any other error if none does."""

    @abstractmethod
    def _os_unmap(self, addr: int, num_pages: int) -> int:
        """Unmap num_pages pages at addr, leaving the range reserved; returns the number of OS calls made. Raise
        `PartialCall` if the first pages were unmapped before the failure, any other error if none was."""

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
        region = Region(self._os_reserve(nbytes), nbytes, vmas=1 if self.merges else 0)
        self.regions.append(region)
        self.stats.reserved_bytes += nbytes
        self._count_mappings(region.vmas)
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
        self._check_pool(page, num_pages, len(self.pool_maps))
        self._check_unmapped(region, first, num_pages)
        delta = self._map_delta(region, first, num_pages, page)
        self._check_mapping_limit(delta, "map")
        t0 = time.perf_counter()
        try:
            calls = self._os_map(region.base + offset, page, num_pages)
        except PartialCall as exc:   # the first pages stayed mapped: book exactly those
            self._book_map(region, first, page, exc.pages_done, self._map_delta(region, first, exc.pages_done, page))
            raise
        finally:
            self.stats.map_seconds += time.perf_counter() - t0
        self.stats.map_calls += calls
        self._book_map(region, first, page, num_pages, delta)

    def unmap(self, region: Region, offset: int, num_pages: int = 1) -> None:
        """Unmap [offset, + num_pages pages): the range stays reserved, the pool pages stay allocated."""
        self._check_open()
        self._unmap(region, offset, num_pages)

    def _unmap(self, region: Region, offset: int, num_pages: int = 1) -> None:
        """`unmap` on an open or a closed driver (a range close() deferred until its last view died)."""
        first = self._va_page(region, offset, num_pages)
        self._check_mapped(region, first, num_pages)
        delta = self._unmap_delta(region, first, num_pages)
        self._check_mapping_limit(delta, "unmap")   # splitting a merged mapping adds VMAs
        t0 = time.perf_counter()
        try:
            calls = self._os_unmap(region.base + offset, num_pages)
        except PartialCall as exc:   # the first pages are gone: book exactly those
            self._book_unmap(region, first, exc.pages_done, self._unmap_delta(region, first, exc.pages_done))
            raise
        finally:
            self.stats.unmap_seconds += time.perf_counter() - t0
        self.stats.unmap_calls += calls
        self._book_unmap(region, first, num_pages, delta)

    # -- places mapped in lockstep (the cache's 2L tensors) -------------------------------------------------
    def mirror(self, places: list[tuple[Region, int]], span: int, pool_stride: int) -> Mirror:
        """Declare places (range, offset) of `span` bytes each that are always mapped in lockstep."""
        self._check_open()
        if span <= 0 or span % self.page_size or pool_stride < 0:
            raise DriverError(f"a mirror needs a whole number of pages per place, not {span} bytes")
        for region, offset in places:
            self._va_page(region, offset, span // self.page_size)
        spans = sorted((id(r), off) for r, off in places)
        if any(a == c and d < b + span for (a, b), (c, d) in pairwise(spans)):
            raise DriverError("mirrored places overlap; give each its own span")
        return Mirror(tuple(places), span, pool_stride)

    def map_mirrored(self, mirror: Mirror, offset: int, page: int, num_pages: int = 1) -> None:
        """Map pool pages [page + i * stride, +num_pages) at `offset` of every place i; all or nothing (a failure
        unmaps the places already mapped)."""
        self._check_mirror_offset(mirror, offset, num_pages)
        self._check_pool(page, num_pages + (len(mirror.places) - 1) * mirror.pool_stride, len(self.pool_maps))
        before = []
        for region, base in mirror.places:   # refuse before any place changes
            va = self._va_page(region, base + offset, num_pages)
            self._check_unmapped(region, va, num_pages)
            before.append((region, va, {}))
        try:
            for i, (region, base) in enumerate(mirror.places):
                self.map(region, base + offset, page + i * mirror.pool_stride, num_pages)
        except BaseException as exc:
            self.repair.undo(exc, "map", offset, num_pages, before)
            raise

    def unmap_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        """Unmap [offset, + num_pages pages) of every place; all or nothing (a failure maps the places already
        unmapped again: the pool pages kept their data)."""
        self._check_mirror_offset(mirror, offset, num_pages)
        before = []
        for region, base in mirror.places:   # refuse before any place changes
            va = self._va_page(region, base + offset, num_pages)
            self._check_mapped(region, va, num_pages)
            pages = region.mapped
            before.append((region, va, {i: pages[i] for i in range(va, va + num_pages)}))
        try:
            for region, base in mirror.places:
                self.unmap(region, base + offset, num_pages)
        except BaseException as exc:
            self.repair.undo(exc, "unmap", offset, num_pages, before)
            raise

    def clear_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        """Unmap whatever is mapped at [offset, + num_pages pages) of each place: the way out of a TornMirror."""
        self._check_mirror_offset(mirror, offset, num_pages)
        places = [(region, self._va_page(region, base + offset, num_pages)) for region, base in mirror.places]
        self.repair.clear(places, offset, num_pages)

    def _check_mirror_offset(self, mirror: Mirror, offset: int, num_pages: int) -> None:
        self._check_open()
        if offset % self.page_size or num_pages < 1 or offset < 0 or offset + num_pages * self.page_size > mirror.span:
            raise DriverError(f"offset {offset} (+{num_pages} pages of {self.page_size} B) is not page-aligned "
                              f"inside a {mirror.span}-byte mirrored place")

    # -- the end of a range, of the driver (vmm/drivers/teardown.py) ---------------------------------------
    def release(self, region: Region) -> None:
        """Unmap what is still mapped and free the reservation; refused while a view of it is alive."""
        self.teardown.release(region)

    def close(self) -> None:
        """Release every range and the pool. Idempotent; always completes (a range a view still reads is released
        when its last view dies)."""
        self.teardown.close()

    def _map_delta(self, region: Region, first: int, num_pages: int, page: int) -> int:
        if not num_pages:
            return 0
        return map_delta(region.pages, first, num_pages, page, region.nbytes // self.page_size) if self.merges \
            else num_pages

    def _unmap_delta(self, region: Region, first: int, num_pages: int) -> int:
        if not num_pages:
            return 0
        return unmap_delta(region.pages, first, num_pages, region.nbytes // self.page_size) if self.merges \
            else -num_pages

    def _book_map(self, region: Region, first: int, page: int, num_pages: int, delta: int) -> None:
        region.pages.update(zip(range(first, first + num_pages), range(page, page + num_pages)))
        pool_maps = self.pool_maps
        for p in range(page, page + num_pages):
            pool_maps[p] += 1
        region.vmas += delta
        self._count_mappings(delta)
        st = self.stats
        st.mapped_pages += num_pages
        st.pages_mapped += num_pages

    def _book_unmap(self, region: Region, first: int, num_pages: int, delta: int) -> None:
        pages, pool_maps = region.pages, self.pool_maps
        for i in range(first, first + num_pages):
            pool_maps[pages.pop(i)] -= 1
        region.vmas += delta
        self._count_mappings(delta)
        st = self.stats
        st.mapped_pages -= num_pages
        st.pages_unmapped += num_pages

    def _check_unmapped(self, region: Region, first: int, num_pages: int) -> None:
        pages = region.mapped
        for i in range(first, first + num_pages):
            if i in pages:
                raise DriverError(f"VA page {i} of the range at {region.base:#x} is already mapped; unmap it first")

    def _check_mapped(self, region: Region, first: int, num_pages: int) -> None:
        pages = region.mapped
        for i in range(first, first + num_pages):
            if i not in pages:
                raise DriverError(f"VA page {i} of the range at {region.base:#x} is not mapped")

    # -- pool memory and views ----------------------------------------------------------------------------
    def discard(self, page: int, num_pages: int = 1) -> None:
        """Give the memory of unmapped pool pages back to the OS/driver. Their contents are undefined when mapped
        again: the host's memfd happens to give zeros, CUDA's cuMemCreate does not zero. Nothing may rely on it:
        kernels read only up to each sequence's written length."""
        self._check_open()
        if any(self.pool_maps[page:page + num_pages]):
            raise DriverError(f"cannot discard pool pages [{page}, {page + num_pages}): some are mapped")
        self._os_discard(page, num_pages)
        self.stats.discarded_pages += num_pages

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

    def _check_pool(self, page: int, num_pages: int, pool_pages: int) -> None:
        if page < 0 or page + num_pages > pool_pages:
            raise DriverError(f"pool pages [{page}, {page + num_pages}) are outside the pool of {pool_pages} pages")

    def _check_mapping_limit(self, delta: int, call: str) -> None:
        """Refuse growth past this driver's limit or the process's budget (MapBudgetExhausted: out of room, nothing
        changed). An unmap is checked against the driver's own limit only: freeing never waits for room."""
        if self.mapping_limit is not None and delta > 0 and self.stats.num_mappings + delta > self.mapping_limit:
            self.stats.map_refusals += 1
            raise MapBudgetExhausted(f"{call} would need {self.stats.num_mappings + delta} mappings, above this "
                                     f"driver's budget of {self.mapping_limit} (vm.max_map_count); use a larger "
                                     "page_size or fewer scattered pages")
        if self.budget is not None and delta > 0 and call != "unmap":
            try:
                self.budget.check(delta, call)
            except MapBudgetExhausted:
                self.stats.map_refusals += 1
                raise

    def _count_mappings(self, delta: int) -> None:
        """Every change of this driver's mapping count, also booked in the process's budget."""
        self.stats.num_mappings += delta
        if self.budget is not None and delta:
            self.budget.add(delta)


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
