"""The accounting-only driver: the seam's bookkeeping with no memory (the simulator's mode)."""
from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers import checks
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.mirror_books import MirrorBooks
from kvlab.vmm.drivers.types import Mirror, Region

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvlab.vmm")


class AccountingVirtualMemory(VirtualMemory):
    """Same bookkeeping over `NoMemory`: addresses are invented, maps cost nothing, views are refused.

    A mirror is booked once for all its places (vmm/drivers/mirror_books.py): its ranges' tables, mapping counts and
    the store page counts are brought up to date when read. A direct map or unmap on one of its ranges ends that
    (logged, counted in `stats.per_place_fallbacks`): from then on the mirror is booked place by place."""

    def __init__(self, page_size: int, merges: bool = True, mapping_limit: int | None = None) -> None:
        self._books: list[MirrorBooks] = []
        super().__init__(NoMemory(page_size, merges), page_size, mapping_limit)

    @property
    def store_maps(self) -> array:
        for books in self._books:
            books.sync()
        return self._store_maps

    @store_maps.setter
    def store_maps(self, value: array) -> None:
        self._store_maps = value

    def mirror(self, places: list[tuple[Region, int]], span: int, store_stride: int) -> Mirror:
        mirror = super().mirror(places, span, store_stride)
        regions = {id(r): r for r, _ in mirror.places}.values()
        if any(r.pages or r.pending is not None for r in regions):   # booked elsewhere already: per place
            return mirror
        books = mirror.books = MirrorBooks(mirror, self.page_size, self.merges, self._store_maps)
        self._books.append(books)
        for region in regions:
            region.pending = books.sync
        return mirror

    def map_mirrored(self, mirror: Mirror, offset: int, page: int, num_pages: int = 1) -> None:
        books = mirror.books
        if books is None:
            return super().map_mirrored(mirror, offset, page, num_pages)
        self._check_open()
        checks.mirror_offset(mirror, offset, num_pages, self.page_size)
        checks.store_pages(page, num_pages + (books.width - 1) * mirror.store_stride, len(self._store_maps))
        first = offset // self.page_size
        books.check_unmapped(first, num_pages)
        delta = books.map_delta(first, num_pages, page)
        self.mappings.check(delta, "map")
        books.map(first, num_pages, page, delta)
        st, pages = self.stats, books.width * num_pages
        st.map_calls += books.width
        st.pages_mapped += pages
        st.mapped_pages += pages
        st.num_mappings += delta

    def unmap_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        books = mirror.books
        if books is None:
            return super().unmap_mirrored(mirror, offset, num_pages)
        self._check_open()
        checks.mirror_offset(mirror, offset, num_pages, self.page_size)
        first = offset // self.page_size
        books.check_mapped(first, num_pages)
        delta = books.unmap_delta(first, num_pages)
        self.mappings.check(delta, "unmap")
        books.unmap(first, num_pages, delta)
        st, pages = self.stats, books.width * num_pages
        st.unmap_calls += books.width
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
            for books in self._books:
                calls, pages, delta = books.unmap_all()
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
        books = next(books for books in self._books if any(r is region for r, _ in books.mirror.places))
        books.sync()
        for r, _ in books.mirror.places:
            r.pending = None
        books.mirror.books = None
        self._books.remove(books)
        if call is not None:
            self.stats.per_place_fallbacks += 1
            log.info("accounting driver: a direct %s on a mirrored range; booking that mirror per place from now "
                     "on (slower)", call)


class NoMemory:
    """The OS calls of no memory (`OSMemory`): addresses are invented, maps cost nothing, views are refused."""

    name = "accounting"

    def __init__(self, page_size: int, merges: bool) -> None:
        self.page_size, self.merges = page_size, merges
        self.unmaps_runs = merges   # the host's calls (cpu), else CUDA's
        self._next_base = 1 << 40

    def granularity(self) -> int:
        return self.page_size

    def reserve(self, nbytes: int) -> int:
        base, self._next_base = self._next_base, self._next_base + nbytes + self.page_size
        return base

    def release(self, region: Region) -> None:
        pass

    def resize_store(self, old_pages: int, new_pages: int) -> None:
        pass

    def map(self, addr: int, first_page: int, num_pages: int) -> int:
        return 1

    def unmap(self, addr: int, num_pages: int) -> int:
        return 1

    def discard(self, first_page: int, num_pages: int) -> None:
        pass

    def view(self, region: Region, offset: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        raise DriverError("the accounting-only driver has no memory to view; use a real device driver")

    def close(self, store_maps: Sequence[int]) -> None:
        pass
