"""The virtual-memory seam: reserve address space, map physical pool pages into it, view it as a tensor.

`VirtualMemory` keeps every piece of bookkeeping (what is mapped where, mapping counts, limits, timings) and
validates each request before the OS/driver sees it; subclasses only make the real calls:
vmm/host.py (mmap + memfd), vmm/cuda.py (CUDA VMM driver API) and `AccountingVirtualMemory` below (no memory,
the simulator's mode). A `Mirror` names places that are always mapped in lockstep (the cache's 2L tensors): one
`map_mirrored` call maps a run of pages in all of them (one OS call per place; the accounting driver books it
once for all). Not thread-safe: the cache serialises every call under its lock.

When a call fails the books still say exactly what is mapped: `map`/`unmap` book the pages an OS call got through
before failing (`PartialCall`), the mirrored calls undo the places already done (all or nothing), and `release`/
`close` try every unmap and free every range even when some fail, then raise one `DriverError` that sums up.
Only when an undo fails too are a mirror's places left apart, and `TornMirror` says so.
"""
from __future__ import annotations

import gc
import logging
import time
import weakref
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from common.errors import DriverError
from vmm.ledger import MirrorLedger
from vmm.vmas import map_delta, unmap_delta

log = logging.getLogger("kvlab.vmm")


class PartialCall(DriverError):
    """Raised by `_os_map`/`_os_unmap` when a call failed after its first `pages_done` pages took effect (and could
    not be undone); any other exception from them means no page changed."""

    def __init__(self, message: str, pages_done: int) -> None:
        super().__init__(message)
        self.pages_done = pages_done


class TornMirror(DriverError):
    """A mirrored call failed and so did its undo: its places no longer match (the books say what each maps)."""


@dataclass(slots=True)
class Region:
    """A reserved virtual range: `mapped` holds the pool page mapped at each mapped VA page index, `segments`
    its OS mappings (host: VMAs incl. PROT_NONE gaps; cuda: mapped pages). Read them through these names: an
    accounting driver may bring them up to date only when they are read (`pending`, vmm/ledger.py)."""
    base: int
    nbytes: int
    pages: dict[int, int] = field(default_factory=dict)
    vmas: int = 1
    live_views: int = 0          # tensor views still alive (weakref.finalize on what each view keeps alive)
    released: bool = False
    orphan_release: Callable[[Region], None] | None = None   # set when its driver died first
    pending: Callable[[], None] | None = None                # brings `pages` and `vmas` up to date

    @property
    def mapped(self) -> dict[int, int]:
        if self.pending is not None:
            self.pending()
        return self.pages

    @property
    def segments(self) -> int:
        if self.pending is not None:
            self.pending()
        return self.vmas


@dataclass(slots=True, eq=False)
class Mirror:
    """Places mapped in lockstep (the vmm cache's 2L tensors): every map or unmap applies at the same offset in
    each place, and place i maps pool page `page + i * pool_stride` where place 0 maps `page`."""
    places: tuple[tuple[Region, int], ...]   # (range, byte offset of the place in it)
    span: int                                # bytes per place
    pool_stride: int
    ledger: MirrorLedger | None = None       # accounting drivers: the books kept once for all places


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
    release_retries: int = 0     # unmaps tried again, page by page, after failing while releasing a range


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
        self.stats.num_mappings += region.vmas
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
        st = self.stats
        st.num_mappings += delta
        st.mapped_pages += num_pages
        st.pages_mapped += num_pages

    def _book_unmap(self, region: Region, first: int, num_pages: int, delta: int) -> None:
        pages, pool_maps = region.pages, self.pool_maps
        for i in range(first, first + num_pages):
            pool_maps[pages.pop(i)] -= 1
        region.vmas += delta
        st = self.stats
        st.num_mappings += delta
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

    # -- places mapped in lockstep ------------------------------------------------------------------------
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
            self._undo_mirrored(exc, "map", offset, num_pages, before)
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
            self._undo_mirrored(exc, "unmap", offset, num_pages, before)
            raise

    def clear_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        """Unmap whatever is mapped at [offset, + num_pages pages) of each place: the way out of a TornMirror.
        Tries every place; raises TornMirror if some unmap still fails."""
        self._check_mirror_offset(mirror, offset, num_pages)
        errors = []
        for region, base in mirror.places:
            errors += self._restore(region, self._va_page(region, base + offset, num_pages), num_pages, {})
        if errors:
            raise TornMirror(f"clearing {num_pages} page(s) at offset {offset} of {len(mirror.places)} mirrored "
                             f"places failed ({errors[0]}); close the cache") from errors[0]

    def _undo_mirrored(self, exc: BaseException, call: str, offset: int, num_pages: int,
                       before: list[tuple[Region, int, dict[int, int]]]) -> None:
        """Put every place's pages [va, +num_pages) back as `before` says (VA page -> pool page; absent: unmapped).
        Returns if that worked (the caller re-raises `exc`); raises TornMirror naming both failures if not."""
        errors = []
        for region, va, want in before:
            errors += self._restore(region, va, num_pages, want)
        if not errors:
            return
        log.error("%s of mirrored pages at offset %d failed (%s) and undoing it failed too (%s); the places no "
                  "longer match", call, offset, exc, errors[0])
        raise TornMirror(f"{call} of {num_pages} page(s) at offset {offset} of {len(before)} mirrored places failed "
                         f"({exc}) and undoing it failed too ({errors[0]}): the places are torn (the driver's books "
                         "say what is mapped); close the cache") from exc

    def _restore(self, region: Region, va: int, num_pages: int, want: dict[int, int]) -> list[DriverError]:
        """Unmap what should not be mapped in [va, +num_pages), then map what is missing; try all, return failures."""
        errors: list[DriverError] = []
        have = region.mapped
        extra = [i for i in range(va, va + num_pages) if i in have and have[i] != want.get(i)]
        for start, count in runs(extra):
            try:
                self.unmap(region, start * self.page_size, count)
            except DriverError as err:
                errors.append(err)
        missing = [i for i in range(va, va + num_pages) if i in want and i not in have]
        for start, count in runs(missing, want):
            try:
                self.map(region, start * self.page_size, want[start], count)
            except DriverError as err:
                errors.append(err)
        return errors

    def discard(self, page: int, num_pages: int = 1) -> None:
        """Give the memory of unmapped pool pages back to the OS/driver; they read as zeros when mapped again."""
        self._check_open()
        if any(self.pool_maps[page:page + num_pages]):
            raise DriverError(f"cannot discard pool pages [{page}, {page + num_pages}): some are mapped")
        self._os_discard(page, num_pages)
        self.stats.discarded_pages += num_pages

    def release(self, region: Region) -> None:
        """Unmap what is still mapped and free the reservation. Refused while a tensor view of it is alive.
        Every unmap is tried (those that fail once again page by page) and the range is freed even when some
        fail; then one DriverError sums up what failed and what is still held."""
        if region.released:
            return
        live = self.live_views(region)
        if live:
            raise DriverError(f"{live} tensor view(s) of the range at {region.base:#x} are still alive; "
                              "drop every view before releasing it")
        errors = self._release(region)
        if errors:
            held = ("the range was released in the end" if region.released else
                    f"the range is still reserved with {len(region.pages)} page(s) mapped")
            raise self._summary(f"releasing the range at {region.base:#x}", errors, held)

    def _release(self, region: Region) -> list[DriverError]:
        errors = self._unmap_all(region)
        try:
            self._os_release(region)
        except DriverError as exc:
            return errors + [exc]
        for start, count in runs(sorted(region.pages)):   # still mapped after failed unmaps: gone with the range
            self._book_unmap(region, start, count, 0)
        region.released = True
        self.regions.remove(region)
        self.stats.reserved_bytes -= region.nbytes
        self.stats.num_mappings -= region.vmas
        return errors

    def _unmap_all(self, region: Region) -> list[DriverError]:
        """Unmap every mapped run; then try what is left once more, page by page, so one page that keeps failing
        leaves only itself mapped. Returns the failures."""
        errors: list[DriverError] = []
        for start, count in runs(sorted(region.mapped)):
            try:
                self.unmap(region, start * self.page_size, count)
            except DriverError as exc:
                errors.append(exc)
        left = sorted(region.pages)
        if left:
            self.stats.release_retries += 1
            log.warning("releasing the range at %#x: %d page(s) failed to unmap (%s); trying them once more, page "
                        "by page", region.base, len(left), errors[0])
        for i in left:
            try:
                self.unmap(region, i * self.page_size)
            except DriverError as exc:
                errors.append(exc)
        return errors

    @staticmethod
    def _summary(what: str, errors: list[DriverError], held: str) -> DriverError:
        """One line for several failures: how many, the distinct messages, and what is still held."""
        messages = list(dict.fromkeys(str(e) for e in errors))
        shown = "; ".join(messages[:3]) + (f"; and {len(messages) - 3} more" if len(messages) > 3 else "")
        exc = DriverError(f"{what}: {len(errors)} driver call(s) failed ({shown}); {held}")
        exc.__cause__ = errors[0]
        return exc

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
        """Release every range and the pool. Idempotent; refused (nothing released) while views are alive. Goes
        on past failures (see `release`) and then raises one DriverError that sums them up."""
        if self.closed:
            return
        live = self.live_views()
        if live:
            raise DriverError(f"{live} tensor view(s) are still alive; drop them before closing the driver")
        errors = []
        for region in list(self.regions):   # keep releasing the rest, then report every failure at once
            errors += self._release(region)
        try:
            self._os_close()
        except DriverError as exc:
            errors.append(exc)
        self.closed = True
        if errors:
            ranges, pages = len(self.regions), self.stats.mapped_pages
            held = (f"still held: {ranges} range(s) with {pages} mapped page(s)" if ranges or pages
                    else "every range was released in the end")
            raise self._summary(f"closing the {self.name} virtual-memory driver", errors, held)

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

    def _check_mirror_offset(self, mirror: Mirror, offset: int, num_pages: int) -> None:
        self._check_open()
        if offset % self.page_size or num_pages < 1 or offset < 0 or offset + num_pages * self.page_size > mirror.span:
            raise DriverError(f"offset {offset} (+{num_pages} pages of {self.page_size} B) is not page-aligned "
                              f"inside a {mirror.span}-byte mirrored place")

    def _check_mapping_limit(self, delta: int, call: str) -> None:
        if self.mapping_limit is not None and delta > 0 and self.stats.num_mappings + delta > self.mapping_limit:
            raise DriverError(f"{call} would need {self.stats.num_mappings + delta} mappings, above this process's "
                              f"budget of {self.mapping_limit} (vm.max_map_count); use a larger page_size or fewer "
                              "scattered pages")


class AccountingVirtualMemory(VirtualMemory):
    """Same bookkeeping, no memory: addresses are invented, maps cost nothing, views are refused.

    A mirror is booked once for all its places (vmm/ledger.py): its ranges' tables, mapping counts and the pool
    page counts are brought up to date when read. A direct map or unmap on one of its ranges ends that (logged,
    counted in `per_place_fallbacks`): from then on the mirror is booked place by place."""

    name = "accounting"

    def __init__(self, page_size: int, merges: bool = True, mapping_limit: int | None = None) -> None:
        self._ledgers: list[MirrorLedger] = []
        super().__init__(page_size, mapping_limit)
        self.merges = merges
        self._next_base = 1 << 40
        self.per_place_fallbacks = 0

    @property
    def pool_maps(self) -> array:
        for ledger in self._ledgers:
            ledger.sync()
        return self._pool_maps

    @pool_maps.setter
    def pool_maps(self, value: array) -> None:
        self._pool_maps = value

    def mirror(self, places: list[tuple[Region, int]], span: int, pool_stride: int) -> Mirror:
        mirror = super().mirror(places, span, pool_stride)
        regions = {id(r): r for r, _ in mirror.places}.values()
        if any(r.pages or r.pending is not None for r in regions):   # booked elsewhere already: per place
            return mirror
        ledger = mirror.ledger = MirrorLedger(mirror, self.page_size, self.merges, self._pool_maps)
        self._ledgers.append(ledger)
        for region in regions:
            region.pending = ledger.sync
        return mirror

    def map_mirrored(self, mirror: Mirror, offset: int, page: int, num_pages: int = 1) -> None:
        ledger = mirror.ledger
        if ledger is None:
            return super().map_mirrored(mirror, offset, page, num_pages)
        self._check_mirror_offset(mirror, offset, num_pages)
        self._check_pool(page, num_pages + (ledger.width - 1) * mirror.pool_stride, len(self._pool_maps))
        first = offset // self.page_size
        ledger.check_unmapped(first, num_pages)
        delta = ledger.map_delta(first, num_pages, page)
        self._check_mapping_limit(delta, "map")
        ledger.map(first, num_pages, page, delta)
        st, pages = self.stats, ledger.width * num_pages
        st.map_calls += ledger.width
        st.pages_mapped += pages
        st.mapped_pages += pages
        st.num_mappings += delta

    def unmap_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        ledger = mirror.ledger
        if ledger is None:
            return super().unmap_mirrored(mirror, offset, num_pages)
        self._check_mirror_offset(mirror, offset, num_pages)
        first = offset // self.page_size
        ledger.check_mapped(first, num_pages)
        delta = ledger.unmap_delta(first, num_pages)
        self._check_mapping_limit(delta, "unmap")
        ledger.unmap(first, num_pages, delta)
        st, pages = self.stats, ledger.width * num_pages
        st.unmap_calls += ledger.width
        st.pages_unmapped += pages
        st.mapped_pages -= pages
        st.num_mappings += delta

    def map(self, region: Region, offset: int, page: int, num_pages: int = 1) -> None:
        self._book_per_place(region, "map")
        super().map(region, offset, page, num_pages)

    def unmap(self, region: Region, offset: int, num_pages: int = 1) -> None:
        self._book_per_place(region, "unmap")
        super().unmap(region, offset, num_pages)

    def release(self, region: Region) -> None:
        self._book_per_place(region, None)
        super().release(region)

    def close(self) -> None:
        """As the base class, but a mirror's pages are unmapped in its books at once, not range by range."""
        if not self.closed and not self.live_views():
            for ledger in self._ledgers:
                calls, pages, delta = ledger.unmap_all()
                st = self.stats
                st.unmap_calls += calls
                st.pages_unmapped += pages
                st.mapped_pages -= pages
                st.num_mappings += delta
        super().close()

    def _book_per_place(self, region: Region, call: str | None) -> None:
        """Before a call on one range of a mirror booked once: write the books out and keep them per place."""
        if region.pending is None:
            return
        ledger = next(ledger for ledger in self._ledgers if any(r is region for r, _ in ledger.mirror.places))
        ledger.sync()
        for r, _ in ledger.mirror.places:
            r.pending = None
        ledger.mirror.ledger = None
        self._ledgers.remove(ledger)
        if call is not None:
            self.per_place_fallbacks += 1
            log.info("accounting driver: a direct %s on a mirrored range; booking that mirror per place from now "
                     "on (slower)", call)

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


def runs(indices: list[int], pages: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """Sorted indices -> (start, length) runs of consecutive values (that, given `pages`, map consecutive pool
    pages)."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i and (pages is None or pages[i] == pages[i - 1] + 1):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
