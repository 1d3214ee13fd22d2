"""The accounting-only driver: the seam's bookkeeping with no memory (the simulator's mode)."""
from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers import checks
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.ledger import MirrorLedger
from kvlab.vmm.drivers.types import Mirror, Region

log = logging.getLogger("kvlab.vmm")


class AccountingVirtualMemory(VirtualMemory):
    """Same bookkeeping over `NoMemory`: addresses are invented, maps cost nothing, views are refused.

    A mirror is booked once for all its places (vmm/drivers/ledger.py): its ranges' tables, mapping counts and the pool
    page counts are brought up to date when read. A direct map or unmap on one of its ranges ends that (logged,
    counted in `stats.per_place_fallbacks`): from then on the mirror is booked place by place."""

    def __init__(self, page_size: int, merges: bool = True, mapping_limit: int | None = None) -> None:
        self._ledgers: list[MirrorLedger] = []
        super().__init__(NoMemory(page_size, merges), page_size, mapping_limit)

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
        self._check_open()
        checks.mirror_offset(mirror, offset, num_pages, self.page_size)
        checks.pool_pages(page, num_pages + (ledger.width - 1) * mirror.pool_stride, len(self._pool_maps))
        first = offset // self.page_size
        ledger.check_unmapped(first, num_pages)
        delta = ledger.map_delta(first, num_pages, page)
        self.mappings.check(delta, "map")
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
        self._check_open()
        checks.mirror_offset(mirror, offset, num_pages, self.page_size)
        first = offset // self.page_size
        ledger.check_mapped(first, num_pages)
        delta = ledger.unmap_delta(first, num_pages)
        self.mappings.check(delta, "unmap")
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
            self.stats.per_place_fallbacks += 1
            log.info("accounting driver: a direct %s on a mirrored range; booking that mirror per place from now "
                     "on (slower)", call)


class NoMemory:
    """The OS calls of no memory (`OSMemory`): addresses are invented, maps cost nothing, views are refused."""

    name = "accounting"

    def __init__(self, page_size: int, merges: bool) -> None:
        self.page_size, self.merges = page_size, merges
        self._next_base = 1 << 40

    def granularity(self) -> int:
        return self.page_size

    def reserve(self, nbytes: int) -> int:
        base, self._next_base = self._next_base, self._next_base + nbytes + self.page_size
        return base

    def release(self, region: Region) -> None:
        pass

    def resize_pool(self, old_pages: int, new_pages: int) -> None:
        pass

    def map(self, addr: int, first_page: int, num_pages: int) -> int:
        return 1

    def unmap(self, addr: int, num_pages: int) -> int:
        return 1

    def discard(self, first_page: int, num_pages: int) -> None:
        pass

    def view(self, region: Region, offset: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        raise DriverError("the accounting-only driver has no memory to view; use a real device driver")

    def close(self, pool_maps: Sequence[int]) -> None:
        pass
