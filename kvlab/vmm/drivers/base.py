"""The virtual-memory seam: reserve address space, map physical store pages into it, view it as a tensor.

`VirtualMemory` keeps every piece of bookkeeping (what is mapped where, mapping counts, limits, timings: its
`PageBooks` base) and validates each request before the OS/driver sees it (vmm/drivers/checks.py); a composed
`OSMemory` (vmm/drivers/types.py) only makes the real calls: vmm/drivers/host.py (mmap + memfd),
vmm/drivers/cuda.py (CUDA VMM driver API) and vmm/drivers/accounting.py (no memory, the simulator's mode). Places
always mapped in lockstep (the cache's 2L tensors) are mapped with one `map_mirrored` call, and a change of the
vmm cache's pages goes down as one batch of them (`apply`); a composed `MirrorRepair` (vmm/drivers/mirror.py)
undoes a failed one, and a composed `Teardown` (vmm/drivers/teardown.py) does `release`/`close`. Not thread-safe:
the cache serialises every call under its lock.

When a call fails the books still say exactly what is mapped: `map`/`unmap` book the pages an OS call got through
before failing (`PartialCall`), the mirrored calls undo the places already done (all or nothing), and `release`/
`close` try every unmap and free every range even when some fail, then raise one `DriverError` that sums up.
"""
from __future__ import annotations

import gc
import logging
import time
import weakref
from array import array
from itertools import pairwise
from typing import TYPE_CHECKING

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers import checks
from kvlab.vmm.drivers.machine_pool import NO_POOL, MachinePool
from kvlab.vmm.drivers.map_budget import MapBudget, MappingCount
from kvlab.vmm.drivers.mirror import MirrorRepair
from kvlab.vmm.drivers.teardown import Teardown
from kvlab.vmm.drivers.types import DriverStats, Mirror, Moves, OSMemory, PartialCall, Region, TornMirror
from kvlab.vmm.drivers.vmas import region_map_delta, region_unmap_delta

if TYPE_CHECKING:
    import torch

__all__ = ["DriverStats", "Mirror", "OSMemory", "PageBooks", "PartialCall", "Region", "VirtualMemory"]
log = logging.getLogger("kvlab.vmm")


class PageBooks:
    """The driver's books over the OS calls of `os` (host, cuda, accounting: vmm/drivers/host.py, cuda.py,
    accounting.py): reserved ranges, the page store, and checked, booked map/unmap of one place (page tables, store
    map counts, stats). `mapping_limit`: the most mappings this driver may create (None: no limit). `budget`: the
    process-wide map budget this driver draws on with every other (vmm/drivers/map_budget.py); `mappings` checks
    and books both."""

    def __init__(self, os: OSMemory, page_size: int, mapping_limit: int | None = None,
                 budget: MapBudget | None = None) -> None:
        self.os, self.name, self.merges, self.unmaps_runs = os, os.name, os.merges, os.unmaps_runs
        self.page_size = page_size
        self.mapping_limit = mapping_limit
        self.budget = budget
        self.stats = DriverStats()
        self.mappings = MappingCount(self.stats, mapping_limit, budget)
        self.regions: list[Region] = []
        self.store_maps = array("i")          # VA mappings of each store page
        self.closed = False

    def reserve(self, nbytes: int) -> Region:
        """Reserve virtual address space (rounded up to whole pages); no physical memory."""
        self._check_open()
        nbytes = -(-max(nbytes, 1) // self.page_size) * self.page_size
        self.mappings.check(1, "reserve")
        region = Region(self.os.reserve(nbytes), nbytes, vmas=1 if self.merges else 0)
        self.regions.append(region)
        self.stats.reserved_bytes += nbytes
        self.mappings.add(region.vmas)
        return region

    def create_store(self, num_pages: int) -> None:
        """Create (or resize) the physical page store: pages 0 .. num_pages-1."""
        self.resize_store(num_pages)

    def resize_store(self, num_pages: int) -> None:
        """Grow the page store, or shrink it and give the cut pages' memory back (they must be unmapped)."""
        self._check_open()
        old = len(self.store_maps)
        if num_pages < old and any(self.store_maps[num_pages:]):
            raise DriverError(f"cannot shrink the page store to {num_pages} pages: pages above it are still mapped")
        self.os.resize_store(old, num_pages)
        if num_pages > old:
            self.store_maps.extend([0] * (num_pages - old))
        else:
            del self.store_maps[num_pages:]
            self.stats.discarded_pages += old - num_pages
        self.stats.store_pages = num_pages

    def map(self, region: Region, offset: int, page: int, num_pages: int = 1) -> None:
        """Map store pages [page, page + num_pages) at region offset `offset` (read-write)."""
        self._check_open()
        first = checks.va_page(region, offset, num_pages, self.page_size)
        checks.store_pages(page, num_pages, len(self.store_maps))
        checks.unmapped(region, first, num_pages)
        self._map_checked(region, offset, first, page, num_pages)

    def _map_checked(self, region: Region, offset: int, first: int, page: int, num_pages: int) -> None:
        """`map` once its request passed the checks (VA page `first` is `offset`'s)."""
        delta = region_map_delta(region, first, num_pages, page, self.page_size, self.merges)
        self.mappings.check(delta, "map")
        t0 = time.perf_counter()
        try:
            calls = self.os.map(region.base + offset, page, num_pages)
        except PartialCall as exc:   # the first pages stayed mapped: book exactly those
            done = exc.pages_done
            self._book_map(region, first, page, done,
                           region_map_delta(region, first, done, page, self.page_size, self.merges))
            raise
        finally:
            self.stats.map_seconds += time.perf_counter() - t0
        self.stats.map_calls += calls
        self._book_map(region, first, page, num_pages, delta)

    def unmap(self, region: Region, offset: int, num_pages: int = 1) -> None:
        """Unmap [offset, + num_pages pages): the range stays reserved, the store pages stay allocated."""
        self._check_open()
        self._unmap(region, offset, num_pages)

    def _unmap(self, region: Region, offset: int, num_pages: int = 1) -> None:
        """`unmap` on an open or a closed driver (a range close() deferred until its last view died)."""
        first = checks.va_page(region, offset, num_pages, self.page_size)
        checks.mapped(region, first, num_pages)
        self._unmap_checked(region, offset, first, num_pages)

    def _unmap_checked(self, region: Region, offset: int, first: int, num_pages: int) -> None:
        """`_unmap` once its request passed the checks (VA page `first` is `offset`'s)."""
        delta = region_unmap_delta(region, first, num_pages, self.page_size, self.merges)
        self.mappings.check(delta, "unmap")   # splitting a merged mapping adds VMAs
        t0 = time.perf_counter()
        try:
            calls = self.os.unmap(region.base + offset, num_pages)
        except PartialCall as exc:   # the first pages are gone: book exactly those
            done = exc.pages_done
            self._book_unmap(region, first, done, region_unmap_delta(region, first, done, self.page_size, self.merges))
            raise
        finally:
            self.stats.unmap_seconds += time.perf_counter() - t0
        self.stats.unmap_calls += calls
        self._book_unmap(region, first, num_pages, delta)

    def _book_map(self, region: Region, first: int, page: int, num_pages: int, delta: int) -> None:
        region.pages.update(zip(range(first, first + num_pages), range(page, page + num_pages)))
        store_maps = self.store_maps
        for p in range(page, page + num_pages):
            store_maps[p] += 1
        region.vmas += delta
        self.mappings.add(delta)
        st = self.stats
        st.mapped_pages += num_pages
        st.pages_mapped += num_pages

    def _book_unmap(self, region: Region, first: int, num_pages: int, delta: int) -> None:
        pages, store_maps = region.pages, self.store_maps
        for i in range(first, first + num_pages):
            store_maps[pages.pop(i)] -= 1
        region.vmas += delta
        self.mappings.add(delta)
        st = self.stats
        st.mapped_pages -= num_pages
        st.pages_unmapped += num_pages

    def live_views(self, region: Region | None = None) -> int:
        def count() -> int:
            return sum(r.live_views for r in self.regions if region is None or r is region)
        if count():
            gc.collect()   # views kept only by reference cycles must not block a release
        return count()

    def _check_open(self) -> None:
        if self.closed:
            raise DriverError(f"the {self.name} virtual-memory driver is closed")


class VirtualMemory(PageBooks):
    """Reserve -> create store -> map/unmap store pages at page-aligned offsets -> tensor views -> release/close.
    On top of the books: places mapped in lockstep (the cache's 2L tensors: `mirror`, the mirrored calls and
    `apply`, a batch of them), release and close, store memory and views. Repairs after a failed mirrored call and
    teardown are composed parts (`repair`, `teardown`). `pool`: the machine-wide pool the physical pages come from
    (vmm/drivers/machine_pool.py; none unless the driver is pooled)."""

    pool: MachinePool = NO_POOL

    def __init__(self, os: OSMemory, page_size: int, mapping_limit: int | None = None,
                 budget: MapBudget | None = None) -> None:
        super().__init__(os, page_size, mapping_limit, budget)
        self.repair = MirrorRepair(self)
        self.teardown = Teardown(self)

    def granularity(self) -> int:
        """The smallest page size the OS/driver allows; page_size is a multiple of it."""
        return self.os.granularity()

    # -- places mapped in lockstep (the cache's 2L tensors) -------------------------------------------------
    def mirror(self, places: list[tuple[Region, int]], span: int, store_stride: int) -> Mirror:
        """Declare places (range, offset) of `span` bytes each that are always mapped in lockstep."""
        self._check_open()
        if span <= 0 or span % self.page_size or store_stride < 0:
            raise DriverError(f"a mirror needs a whole number of pages per place, not {span} bytes")
        for region, offset in places:
            checks.va_page(region, offset, span // self.page_size, self.page_size)
        spans = sorted((id(r), off) for r, off in places)
        if any(a == c and d < b + span for (a, b), (c, d) in pairwise(spans)):
            raise DriverError("mirrored places overlap; give each its own span")
        return Mirror(tuple(places), span, store_stride)

    def map_mirrored(self, mirror: Mirror, offset: int, page: int, num_pages: int = 1) -> None:
        """Map store pages [page + i * stride, +num_pages) at `offset` of every place i; all or nothing (a failure
        unmaps the places already mapped)."""
        self._check_open()
        checks.mirror_offset(mirror, offset, num_pages, self.page_size)
        checks.store_pages(page, num_pages + (len(mirror.places) - 1) * mirror.store_stride, len(self.store_maps))
        before = []
        for region, base in mirror.places:   # refuse before any place changes
            va = checks.va_page(region, base + offset, num_pages, self.page_size)
            checks.unmapped(region, va, num_pages)
            before.append((region, va, {}))
        try:
            for i, (region, va, _) in enumerate(before):
                self._map_checked(region, mirror.places[i][1] + offset, va, page + i * mirror.store_stride, num_pages)
        except BaseException as exc:
            self.repair.undo(exc, "map", offset, num_pages, before)
            raise

    def unmap_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        """Unmap [offset, + num_pages pages) of every place; all or nothing (a failure maps the places already
        unmapped again: the store pages kept their data)."""
        self._check_open()
        checks.mirror_offset(mirror, offset, num_pages, self.page_size)
        before = []
        for region, base in mirror.places:   # refuse before any place changes
            va = checks.va_page(region, base + offset, num_pages, self.page_size)
            checks.mapped(region, va, num_pages)
            pages = region.mapped
            before.append((region, va, {i: pages[i] for i in range(va, va + num_pages)}))
        try:
            for (region, va, _), (_, base) in zip(before, mirror.places):
                self._unmap_checked(region, base + offset, va, num_pages)
        except BaseException as exc:
            self.repair.undo(exc, "unmap", offset, num_pages, before)
            raise

    def clear_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        """Unmap whatever is mapped at [offset, + num_pages pages) of each place: the way out of a TornMirror."""
        self._check_open()
        checks.mirror_offset(mirror, offset, num_pages, self.page_size)
        places = [(region, checks.va_page(region, base + offset, num_pages, self.page_size))
                  for region, base in mirror.places]
        self.repair.clear(places, offset, num_pages)

    def apply(self, mirror: Mirror, moves: Moves) -> None:
        """Carry out a batch of mirrored calls in order (one change of the vmm cache's pages): hold pool pages,
        unmap (or clear), map. The first failure stops it; a failed map first unmaps the maps of the batch before
        it. `moves` says afterwards how far it got."""
        if moves.hold:
            self.pool.hold(moves.hold)
        for i, (offset, num_pages) in enumerate(moves.unmaps):
            try:
                (self.clear_mirrored if i in moves.clear else self.unmap_mirrored)(mirror, offset, num_pages)
            except TornMirror:
                moves.torn = ("unmap", i)
                raise
            moves.unmapped += 1
        for i, (offset, page, num_pages) in enumerate(moves.maps):
            try:
                self.map_mirrored(mirror, offset, page, num_pages)
            except TornMirror:
                moves.torn, moves.mapped = ("map", i), i + 1   # partly mapped: it counts as mapped
                raise
            except BaseException:
                self._unmap_back(mirror, moves, i)
                raise
            moves.mapped += 1

    def _unmap_back(self, mirror: Mirror, moves: Moves, failed: int) -> None:
        """Unmap the batch's maps before map `failed`, last first; if one of those unmaps fails too, it and the
        maps before it stay mapped (`moves.mapped`)."""
        for i in range(failed - 1, -1, -1):
            offset, _, num_pages = moves.maps[i]
            try:
                self.unmap_mirrored(mirror, offset, num_pages)
            except DriverError as exc:
                if isinstance(exc, TornMirror):
                    moves.torn = ("map", i)
                log.error("vmm: undoing a failed map failed too (%s); the %d maps before it stay mapped", exc, i + 1)
                moves.mapped = i + 1
                return
        moves.mapped = 0

    # -- the end of a range, of the driver (vmm/drivers/teardown.py) ---------------------------------------
    def release(self, region: Region) -> None:
        """Unmap what is still mapped and free the reservation; refused while a view of it is alive."""
        self.teardown.release(region)

    def close(self) -> None:
        """Release every range and the page store. Idempotent; always completes (a range a view still reads is released
        when its last view dies)."""
        self.teardown.close()

    # -- store memory and views ---------------------------------------------------------------------------
    def discard(self, page: int, num_pages: int = 1) -> None:
        """Give the memory of unmapped store pages back to the OS/driver. Their contents are undefined when mapped
        again: the host's memfd happens to give zeros, CUDA's cuMemCreate does not zero. Nothing may rely on it:
        kernels read only up to each sequence's written length."""
        self._check_open()
        if any(self.store_maps[page:page + num_pages]):
            raise DriverError(f"cannot discard store pages [{page}, {page + num_pages}): some are mapped")
        self.os.discard(page, num_pages)
        self.stats.discarded_pages += num_pages

    def tensor_view(self, region: Region, dtype: torch.dtype, shape: tuple[int, ...],
                    strides: tuple[int, ...] | None = None, offset: int = 0) -> torch.Tensor:
        """A zero-copy tensor over the range (never reads memory). `strides` in elements, default contiguous;
        `offset` in bytes from the start of the range."""
        self._check_open()
        itemsize = dtype.itemsize
        strides = strides or contiguous_strides(shape)
        span = itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, strides))) if all(shape) else 0
        if offset % itemsize or offset < 0 or offset + span > region.nbytes:
            raise DriverError(f"a view of {span} bytes at offset {offset} does not fit the {region.nbytes}-byte "
                              f"range at {region.base:#x}")
        raw, holder = self.os.view(region, offset, region.nbytes - offset)
        region.live_views += 1
        weakref.finalize(holder, _view_dropped, region)
        return raw.view(dtype).as_strided(shape, strides)


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
