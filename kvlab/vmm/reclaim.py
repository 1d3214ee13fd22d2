"""Taking page groups for a move of the pages room (vmm/pages.py), booked before any driver call: from the free
list, and when it runs short from pages no live token needs (parked pages of the oldest freed slots first, then
pages mapped ahead in live slots, then the requester's own beyond what it keeps), then idle cached pages (evicted).
A reclaimed tail is taken off its slot's list at once; its unmap is the caller's to carry out, and `relist` puts
back the tails whose unmap did not happen."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.errors import OutOfKVCache

if TYPE_CHECKING:
    from kvlab.vmm.free_pages import FreePages, PageCounters
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import Slot, SlotTable

Reclaimed = tuple["Slot", int, list[int]]   # a tail booked as reclaimed: its slot, its first page, its groups


class Reclaim:
    """`whole_tails`: a freed slot's parked pages go all at once (where one call unmaps a run however long, so the
    pages past the need wait on the free list for the next growths, which then only map); else only as many as
    needed (where unmaps cost per page, CUDA's, or run off the step: background mapping)."""

    def __init__(self, geo: Geometry, free_pages: FreePages, table: SlotTable, counters: PageCounters,
                 whole_tails: bool) -> None:
        self.geo, self.free_pages, self.table, self.counters = geo, free_pages, table, counters
        self.whole_tails = whole_tails

    def obtain(self, count: int, requester: Slot, keep: int, prefer: int | None) -> tuple[list[int], list[Reclaimed]]:
        """`count` groups taken from the free list (the ones right after `prefer` if free), and the tails reclaimed
        to make room for them."""
        free, reclaimed = self.free_pages, []
        if free.num_free < count:
            self.reclaim(count - free.num_free, requester, keep, reclaimed)
        if free.num_free < count:   # idle cached pages are evicted last, whole groups, oldest first
            free.evict(count - free.num_free)
        if free.num_free < count:   # unreachable if callers checked num_free_units(); never map half
            error = OutOfKVCache(f"need {count} pages, only {free.num_free} could be freed")
            self.relist(reclaimed)
            raise error
        return free.take(count, prefer), reclaimed

    def reclaim(self, count: int, requester: Slot, keep: int, out: list[Reclaimed]) -> None:
        """Book tail pages as reclaimed: oldest free (stale) slots first, then pages mapped ahead in live slots (by
        index), then the requester's own beyond `keep`."""
        table = self.table
        count = self.stale(count, out)
        for index in sorted(table.ahead - {requester.index}) if count > 0 else ():
            slot = table.slots[index]
            count -= self._tail(slot, min(count, len(slot.groups) - self.geo.pages_for(slot.held)), out)
            if count <= 0:
                return
        if count > 0:   # never a page under the tokens it holds (a fork child may hold more than it asks for)
            keep = max(keep, self.geo.pages_for(requester.held))
            self._tail(requester, min(count, len(requester.groups) - keep), out)

    def stale(self, count: int, out: list[Reclaimed]) -> int:
        """Book parked pages of the oldest freed slots until `count` are booked (whole tails: see the class);
        returns how many are still wanted."""
        table = self.table
        while count > 0 and table.stale:
            slot = table.slots[next(iter(table.stale))]
            count -= self._tail(slot, len(slot.groups) if self.whole_tails else min(count, len(slot.groups)), out)
        return max(count, 0)

    def _tail(self, slot: Slot, n: int, out: list[Reclaimed]) -> int:
        if n <= 0:
            return 0
        first = len(slot.groups) - n
        groups = slot.groups[first:]
        with self.table.accounting(slot):
            del slot.groups[first:]
        self.free_pages.put_back(groups)
        out.append((slot, first, groups))
        self.counters.reclaimed_units += n
        return n

    def relist(self, reclaimed: list[Reclaimed]) -> None:
        """Tails booked as reclaimed whose unmap did not happen: listed in their slots again."""
        for slot, first, groups in reversed(reclaimed):
            assert len(slot.groups) == first, f"slot {slot.index} changed while its tail was booked as reclaimed"
            self.free_pages.retake(groups)
            with self.table.accounting(slot):
                slot.groups.extend(groups)
            self.counters.reclaimed_units -= len(groups)
        if reclaimed:
            self.table.sort_stale()
