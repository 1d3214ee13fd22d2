"""Moving page groups between the pool and slot rows, mapping them in every tensor through the driver.

A slot grows by taking groups from the pool (contiguous after its last page when possible); a fork child maps
its parent's groups (shared, copy-on-write); a write to a shared page first gives the writer its own copy.
When the pool runs short, pages no live token needs are reclaimed: parked pages of the oldest freed slots
first, then pages mapped ahead in live slots.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common.errors import OutOfKVCache

if TYPE_CHECKING:
    from vmm.driver import VirtualMemory
    from vmm.geometry import Geometry
    from vmm.page_pool import PagePool
    from vmm.slots import Slot, SlotTable
    from vmm.tensors import VirtualTensors

log = logging.getLogger("kvlab.vmm")


class SlotPages:
    def __init__(self, geo: Geometry, driver: VirtualMemory, tensors: VirtualTensors, pool: PagePool,
                 table: SlotTable, counters: dict[str, int]) -> None:
        self.geo, self.driver, self.tensors = geo, driver, tensors
        self.pool, self.table = pool, table
        self.counters = counters

    def shared_pages(self, slot: Slot, start: int, end: int) -> list[int]:
        """Pages of `slot` that writes to positions [start, end) touch and another slot also maps."""
        if not self.pool.num_shared:   # no fork shares a page: the per-step path stops here
            return []
        last = min(self.geo.pages_for(end), len(slot.groups))
        return [j for j in range(start // self.geo.tokens_per_page, last) if self.pool.is_shared(slot.groups[j])]

    def grow(self, slot: Slot, pages: int) -> None:
        missing = pages - len(slot.groups)
        if missing <= 0:
            return
        self._extend(slot, self._obtain(missing, slot, keep=pages, prefer=_after_last(slot)))

    def map_ahead(self, index: int, seq_id: int, target: int) -> bool:
        """Map pages the slot will need soon, from the free pool only (never reclaims). False if nothing
        was mapped."""
        slot = self.table.slots[index]
        if slot.seq_id != seq_id or len(slot.groups) >= target:
            return False
        count = min(target - len(slot.groups), self.pool.num_free)
        if count <= 0:
            self.counters["lookahead_skipped"] += 1
            log.debug("background mapping skipped for slot %d: the pool is empty", index)
            return False
        self._extend(slot, self.pool.take(count, _after_last(slot)))
        self.counters["lookahead_pages"] += count
        return True

    def share(self, source: Slot, target: Slot) -> None:
        """Map the source's live pages into a just-claimed target (a fork child); its stale pages go back."""
        shared = source.groups[:self.geo.pages_for(source.held)]
        with self.table.accounting(target):
            self.drop_tail(target, len(target.groups))
            self._map(target, 0, shared)
            target.groups.extend(shared)
            self.pool.share(shared)
            target.held = source.held

    def copy_on_write(self, slot: Slot, start: int, end: int) -> None:
        for j in self.shared_pages(slot, start, end):
            old = slot.groups[j]
            prefer = slot.groups[j - 1] + 1 if j else None
            new = self._obtain(1, slot, keep=self.geo.pages_for(end), prefer=prefer)[0]
            saved = self.tensors.save_page(slot.index, j)
            self.tensors.unmap(slot.index, j, 1)
            try:
                self._map(slot, j, [new])
            except BaseException:
                self._map(slot, j, [old])   # put the shared page back; the slot stays consistent
                raise
            self.pool.unshare(old)
            slot.groups[j] = new
            self.pool.own([new])
            self.tensors.restore_page(slot.index, j, saved)
            self.counters["cow_copies"] += 1

    def release(self, slot: Slot) -> None:
        """Free the slot but keep its exclusive pages mapped (deferred reclamation); drop shared pages."""
        if self.pool.num_shared:
            shared = next((j for j, g in enumerate(slot.groups) if self.pool.is_shared(g)), None)
            if shared is not None:   # keep the exclusive prefix only, so a free slot never holds a shared page
                with self.table.accounting(slot):
                    self.drop_tail(slot, len(slot.groups) - shared)
        self.table.vacate(slot)

    def drop_tail(self, slot: Slot, count: int) -> None:
        if count <= 0:
            return
        first = len(slot.groups) - count
        self.tensors.unmap(slot.index, first, count)
        self.pool.put_back(slot.groups[first:])
        del slot.groups[first:]

    # -- taking from the pool -----------------------------------------------------------------------------
    def _extend(self, slot: Slot, new: list[int]) -> None:
        with self.table.accounting(slot):
            self._map(slot, len(slot.groups), new)
            slot.groups.extend(new)
            self.pool.own(new)

    def _obtain(self, count: int, requester: Slot, keep: int, prefer: int | None) -> list[int]:
        """`count` groups from the pool, reclaiming pages no live token needs when the pool runs short."""
        if self.pool.num_free < count:
            self._reclaim(count - self.pool.num_free, requester, keep)
        if self.pool.num_free < count:   # unreachable if callers checked num_free_units(); never map half
            raise OutOfKVCache(f"need {count} pages, only {self.pool.num_free} could be freed")
        return self.pool.take(count, prefer)

    def _reclaim(self, count: int, requester: Slot, keep: int) -> None:
        """Unmap tail pages: oldest free (stale) slots first, then pages mapped ahead in live slots (by index),
        then the requester's own beyond `keep`."""
        table = self.table
        while count > 0 and table.stale:
            slot = table.slots[next(iter(table.stale))]
            count -= self._reclaim_tail(slot, min(count, len(slot.groups)))
        for index in sorted(table.ahead - {requester.index}) if count > 0 else ():
            slot = table.slots[index]
            count -= self._reclaim_tail(slot, min(count, len(slot.groups) - self.geo.pages_for(slot.held)))
            if count <= 0:
                return
        if count > 0:
            self._reclaim_tail(requester, min(count, len(requester.groups) - keep))

    def _reclaim_tail(self, slot: Slot, n: int) -> int:
        if n > 0:
            with self.table.accounting(slot):
                self.drop_tail(slot, n)
            self.counters["reclaimed_units"] += n
        return max(n, 0)

    # -- driver calls -------------------------------------------------------------------------------------
    def _map(self, slot: Slot, first_page: int, groups: list[int]) -> None:
        """Map `groups` at pages first_page.. of the slot in every tensor, one call per run; all or nothing."""
        done: list[tuple[int, int]] = []
        try:
            for start, n in group_runs(groups):
                self.tensors.map(slot.index, first_page + start, groups[start], n)
                done.append((first_page + start, n))
        except BaseException:
            for page, n in done:
                self.tensors.unmap(slot.index, page, n)
            self.pool.return_untaken(groups)   # groups fresh from the pool go back to it
            raise


def _after_last(slot: Slot) -> int | None:
    """The group right after the slot's last one: taking it keeps the mapping contiguous."""
    return slot.groups[-1] + 1 if slot.groups else None


def group_runs(groups: list[int]) -> list[tuple[int, int]]:
    """(index, length) runs of consecutive group ids (each run is one map call per tensor)."""
    out: list[tuple[int, int]] = []
    for i, g in enumerate(groups):
        if out and groups[out[-1][0]] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
