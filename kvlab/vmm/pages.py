"""The pages room of the vmm cache: moving page groups between the free list (vmm/free_pages.py) and slot rows
(`SlotPages`), each move mapped in every tensor through the driver (`SlotMaps`: one mirrored driver call per run of
consecutive groups maps a page in all 2L tensors at once).

A slot grows by taking groups from the free list (contiguous after its last page when possible); a fork child maps
its parent's groups (shared, copy-on-write); a write to a shared page first gives the writer its own copy. When the
free list runs short, pages no live token needs are reclaimed: parked pages of the oldest freed slots first, then
pages mapped ahead in live slots.

Every change is all or nothing: a failed step undoes the steps before it (groups taken from the free list go back,
a failed run unmaps the runs before it), so a DriverError leaves slots, free list and mappings as they were. Only if
an undo fails too (`TornMirror`) does a slot list a page that is not mapped in every tensor; such pages are
remembered (`torn`) and cleared, not unmapped, later; check_invariants reports them, and the cache must be closed.
A copy-on-write remaps the page and orders the storage to copy its bytes (`CopyKV`, common/kv/types.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlab.common.errors import DriverError, OutOfKVCache
from kvlab.common.kv.types import CopyKV
from kvlab.vmm.drivers.types import TornMirror
from kvlab.vmm.free_pages import PageCounters
from kvlab.vmm.slots import DROPPED

if TYPE_CHECKING:
    from kvlab.common.kv.types import MoveSink
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.drivers.types import Mirror
    from kvlab.vmm.free_pages import FreePages
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import Slot, SlotTable

log = logging.getLogger("kvlab.vmm")


class SlotPages:
    """Moves of page groups; every map and unmap is one mirrored driver call for all 2L tensors (`maps`)."""

    def __init__(self, geo: Geometry, driver: VirtualMemory, mirror: Mirror, free_pages: FreePages,
                 table: SlotTable) -> None:
        self.geo, self.free_pages, self.table = geo, free_pages, table
        self.counters = PageCounters()
        self.maps = SlotMaps(geo, driver, mirror, free_pages, self.counters)

    def shared_pages(self, slot: Slot, start: int, end: int) -> list[int]:
        """Pages of `slot` that writes to positions [start, end) touch and another slot also maps."""
        if not self.free_pages.num_shared:   # no fork shares a page: the per-step path stops here
            return []
        last = min(self.geo.pages_for(end), len(slot.groups))
        first = max(start // self.geo.tokens_per_page, slot.dropped)   # never below the window's unmapped pages
        return [j for j in range(first, last) if self.free_pages.is_shared(slot.groups[j])]

    def grow(self, slot: Slot, pages: int) -> None:
        missing = pages - len(slot.groups)
        if missing <= 0:
            return
        self._extend(slot, self._obtain(missing, slot, keep=pages, prefer=_after_last(slot)))

    def map_ahead(self, index: int, seq_id: int, target: int) -> bool:
        """Map pages the slot will need soon, from the free list and parked pages of freed slots (never pages a
        live slot maps). False if nothing was mapped."""
        slot = self.table.slots[index]
        if slot.seq_id != seq_id or len(slot.groups) >= target:
            return False
        if self.free_pages.num_free < target - len(slot.groups):   # parked pages of freed slots: anyone's
            self._reclaim_stale(target - len(slot.groups) - self.free_pages.num_free)
        count = min(target - len(slot.groups), self.free_pages.num_free)
        if count <= 0:
            self.counters.lookahead_skipped += 1
            log.debug("background mapping skipped for slot %d: no page group is free", index)
            return False
        self._extend(slot, self.free_pages.take(count, _after_last(slot)))
        self.counters.lookahead_pages += count
        return True

    def alias(self, slot: Slot, groups: list[int], tokens: int) -> None:
        """Map cached groups (a prefix hit) at pages 0.. of a just-claimed slot; its stale pages go back first."""
        with self.table.accounting(slot):
            self.drop_tail(slot, len(slot.groups))
            self.maps.append(slot, groups, shared=True)
            slot.held = tokens

    def share(self, source: Slot, target: Slot) -> None:
        """Map the source's live pages into a just-claimed target (a fork child) at the same pages (below the
        source's window too: none); the target's stale pages go back."""
        shared = source.groups[source.dropped:self.geo.pages_for(source.held)]
        with self.table.accounting(target):
            self.open_window(target, source.dropped)
            self.maps.append(target, shared, shared=True)
            target.held = source.held

    def open_window(self, slot: Slot, dropped: int) -> None:
        """A just-claimed slot whose first `dropped` pages a sliding window left behind: its stale pages go back
        and its list starts with `dropped` DROPPED entries (the next pages map after them). Call in accounting."""
        self.drop_tail(slot, len(slot.groups))
        slot.groups.extend([DROPPED] * dropped)
        slot.dropped = dropped

    def drop_below(self, slot: Slot, end: int) -> None:
        """Sliding window: unmap the slot's pages [dropped, end) in every tensor (one mirrored call; no kernel reads
        them again) and give their groups back (a group a fork shares stays mapped in the other slots). The list
        keeps DROPPED in their place, so page j still sits at index j. Held tokens and reclaimable pages are
        unchanged: no accounting context needed."""
        first, count = slot.dropped, end - slot.dropped
        if count <= 0:
            return
        self.maps.unmap(slot, first, end)
        self.free_pages.put_back(slot.groups[first:end])
        slot.groups[first:end] = [DROPPED] * count
        slot.dropped = end
        self.counters.window_dropped_pages += count

    def copy_on_write(self, slot: Slot, start: int, end: int, emit: MoveSink) -> None:
        """Give the slot its own copy of each shared page the writes touch; each copy all or nothing: remapped, then
        its bytes copied by the storage from a slot that still maps the shared page (at the same page index)."""
        for j in self.shared_pages(slot, start, end):
            old = slot.groups[j]
            prefer = slot.groups[j - 1] + 1 if j else None
            new = self._obtain(1, slot, keep=self.geo.pages_for(end), prefer=prefer)[0]
            self.maps.remap(slot, j, old, new)
            emit(CopyKV((self._mapping(old, j), j), (slot.index, j), self.geo.tokens_per_page))
            self.counters.cow_copies += 1

    def _mapping(self, group: int, j: int) -> int:
        """A slot that maps `group` at page j (a shared group sits at the same page index in every slot)."""
        return next(s.index for s in self.table.slots if len(s.groups) > j and s.groups[j] == group)

    def new_slot(self, seq_id: int, tokens: int, fill: Callable[[Slot], None], fewest_pages: bool) -> Slot:
        """A slot claimed for `seq_id` that `fill` maps pages into; if filling fails it is released (the sequence
        holds nothing) and the error raised."""
        slot = self.table.claim(seq_id, tokens, fewest_pages)
        try:
            fill(slot)
        except BaseException:
            self.release(slot)
            raise
        return slot

    def release(self, slot: Slot) -> None:
        """Free the slot but keep its exclusive pages mapped (deferred reclamation); drop shared pages (and torn
        ones: a later owner must not inherit them)."""
        if slot.dropped:   # pages from `dropped` on are no use to a later owner, who needs page 0 first
            with self.table.accounting(slot):
                self.drop_tail(slot, len(slot.groups) - slot.dropped)
                slot.groups.clear()
                slot.dropped = 0
            self.table.vacate(slot)
            return
        drop = None
        free = self.free_pages
        if free.num_shared or free.cache is not None:   # a free slot never maps a cached page either
            drop = next((j for j, g in enumerate(slot.groups) if free.is_shared(g) or free.is_cached(g)), None)
        if self.maps.torn:
            drop = min((j for j in (drop, self.maps.first_torn(slot)) if j is not None), default=None)
        if drop is not None:   # keep the prefix before it only: a free slot never holds a shared or torn page
            with self.table.accounting(slot):
                self.drop_tail(slot, len(slot.groups) - drop)
        self.table.vacate(slot)

    def drop_all(self, slot: Slot) -> None:
        """Unmap every page the slot maps (all or nothing) and put their groups back."""
        with self.table.accounting(slot):
            self.drop_tail(slot, len(slot.groups))

    def fill_with(self, slot: Slot, count: int, tokens: int, back: Callable[[list[int]], None]) -> None:
        """Fill a just-claimed slot (its stale pages go) with `count` groups that `back` gives their memory before
        they are mapped (a handoff's received pages); the slot holds `tokens`."""
        self.drop_all(slot)
        groups = self._obtain(count, slot, keep=count, prefer=None)
        try:
            back(groups)
        except BaseException:
            self.free_pages.return_untaken(groups)
            raise
        with self.table.accounting(slot):
            self.maps.append(slot, groups, shared=False)
            slot.held = tokens

    def drop_tail(self, slot: Slot, count: int) -> None:
        """Unmap the slot's last `count` pages (all or nothing) and put their groups back."""
        if count <= 0:
            return
        first, end = len(slot.groups) - count, len(slot.groups)
        self.maps.unmap(slot, first, end)
        self.free_pages.put_back(slot.groups[first:])
        del slot.groups[first:]

    # -- taking free groups ------------------------------------------------------------------------------
    def _extend(self, slot: Slot, new: list[int]) -> None:
        with self.table.accounting(slot):
            self.maps.append(slot, new, shared=False)

    def _obtain(self, count: int, requester: Slot, keep: int, prefer: int | None) -> list[int]:
        """`count` groups from the free list, reclaiming pages no live token needs when the free list runs short."""
        if self.free_pages.num_free < count:
            self._reclaim(count - self.free_pages.num_free, requester, keep)
        if self.free_pages.num_free < count:   # idle cached pages are evicted last, whole groups, oldest first
            self.free_pages.evict(count - self.free_pages.num_free)
        if self.free_pages.num_free < count:   # unreachable if callers checked num_free_units(); never map half
            raise OutOfKVCache(f"need {count} pages, only {self.free_pages.num_free} could be freed")
        return self.free_pages.take(count, prefer)

    def _reclaim(self, count: int, requester: Slot, keep: int) -> None:
        """Unmap tail pages: oldest free (stale) slots first, then pages mapped ahead in live slots (by index),
        then the requester's own beyond `keep`."""
        table = self.table
        count = self._reclaim_stale(count)
        for index in sorted(table.ahead - {requester.index}) if count > 0 else ():
            slot = table.slots[index]
            count -= self._reclaim_tail(slot, min(count, len(slot.groups) - self.geo.pages_for(slot.held)))
            if count <= 0:
                return
        if count > 0:
            self._reclaim_tail(requester, min(count, len(requester.groups) - keep))

    def _reclaim_stale(self, count: int) -> int:
        """Unmap up to `count` parked pages, oldest freed slots first; returns how many are still wanted."""
        table = self.table
        while count > 0 and table.stale:
            slot = table.slots[next(iter(table.stale))]
            count -= self._reclaim_tail(slot, min(count, len(slot.groups)))
        return count

    def _reclaim_tail(self, slot: Slot, n: int) -> int:
        if n > 0:
            with self.table.accounting(slot):
                self.drop_tail(slot, n)
            self.counters.reclaimed_units += n
        return max(n, 0)


def _after_last(slot: Slot) -> int | None:
    """The group right after the slot's last one: taking it keeps the mapping contiguous."""
    return slot.groups[-1] + 1 if slot.groups else None


log = logging.getLogger("kvlab.vmm")


class SlotMaps:
    """The driver calls of the page moves (`SlotPages`), addressed by (slot, page); mapping lists the groups in
    the slot and counts them in the free list."""

    def __init__(self, geo: Geometry, driver: VirtualMemory, mirror: Mirror, free_pages: FreePages,
                 counters: PageCounters) -> None:
        self.driver, self.mirror, self.free_pages, self.counters = driver, mirror, free_pages, counters
        self.torn: set[tuple[int, int]] = set()   # (slot, page) maybe not mapped alike in every tensor (TornMirror)
        self._row_bytes, self._page_size = geo.row_bytes, geo.page_size

    def _at(self, slot: int, page: int) -> int:
        """Where page `page` of slot `slot` sits inside each tensor."""
        return slot * self._row_bytes + page * self._page_size

    def append(self, slot: Slot, groups: list[int], shared: bool) -> None:
        """Map `groups` after the slot's last page (one call per run) and list them: owned (fresh from the free list) or
        shared (a fork, a prefix hit). All or nothing: a failure unmaps the runs mapped so far and gives fresh
        groups back to the free list. Should an undo fail too, what is still (partly) mapped stays listed."""
        first, mapped = len(slot.groups), 0
        try:
            for start, n in group_runs(groups):
                mapped = start + n
                self.driver.map_mirrored(self.mirror, self._at(slot.index, first + start), groups[start], n)
        except TornMirror:
            self.mark_torn(slot, first + start, n)
            raise
        except BaseException:
            mapped = self._unmap_back(slot, first, groups, start)   # the failed run left nothing mapped
            raise
        finally:
            self._list(slot, groups, mapped, shared)

    def _list(self, slot: Slot, groups: list[int], mapped: int, shared: bool) -> None:
        kept = groups[:mapped]
        slot.groups.extend(kept)
        if shared:
            self.free_pages.share(kept)
        else:
            self.free_pages.own(kept)
            self.free_pages.return_untaken(groups[mapped:])

    def _unmap_back(self, slot: Slot, first: int, groups: list[int], mapped: int) -> int:
        """Unmap the runs of groups[:mapped] (mapped at pages first..), last first; returns how many groups stay
        mapped (all up to the run whose unmap failed)."""
        for start, n in reversed(group_runs(groups[:mapped])):
            try:
                self.driver.unmap_mirrored(self.mirror, self._at(slot.index, first + start), n)
            except DriverError as exc:
                if isinstance(exc, TornMirror):
                    self.mark_torn(slot, first + start, n)
                log.error("vmm: undoing a failed map of slot %d failed too (%s); pages %d..%d stay mapped and listed",
                          slot.index, exc, first, first + start + n - 1)
                return start + n
        return 0

    def unmap(self, slot: Slot, first: int, end: int) -> None:
        """Unmap pages [first, end) of the slot in every tensor, all or nothing (a torn page is cleared instead)."""
        count = end - first
        torn = [(slot.index, j) for j in range(first, end) if (slot.index, j) in self.torn] if self.torn else []
        try:
            if torn:
                self.driver.clear_mirrored(self.mirror, self._at(slot.index, first), count)
            else:
                self.driver.unmap_mirrored(self.mirror, self._at(slot.index, first), count)
        except TornMirror:
            self.mark_torn(slot, first, count)
            raise
        if torn:
            self.torn.difference_update(torn)
            self.counters.torn_pages = len(self.torn)

    def remap(self, slot: Slot, j: int, old: int, new: int) -> None:
        """Copy-on-write's driver calls: group `new` (just taken) at page j in place of the shared `old`. A failure
        gives `new` back and leaves `old` mapped; if mapping `old` back fails too: TornMirror."""
        at = self._at(slot.index, j)
        try:
            self.driver.unmap_mirrored(self.mirror, at, 1)
        except BaseException as exc:
            self.free_pages.return_untaken([new])   # the slot still lists `old`
            if isinstance(exc, TornMirror):
                self.mark_torn(slot, j, 1)
            raise
        try:
            self.driver.map_mirrored(self.mirror, at, new, 1)
        except TornMirror:
            self._take(slot, j, old, new)   # partly mapped: the slot lists the copy
            self.mark_torn(slot, j, 1)
            raise
        except BaseException as exc:
            self.free_pages.return_untaken([new])
            self._map_back(slot, j, old, exc)
            raise
        self._take(slot, j, old, new)

    def _take(self, slot: Slot, j: int, old: int, new: int) -> None:
        self.free_pages.unshare(old)
        slot.groups[j] = new
        self.free_pages.own([new])

    def _map_back(self, slot: Slot, j: int, old: int, exc: BaseException) -> None:
        """Map the shared group `old` back at page j after its copy failed to map."""
        try:
            self.driver.map_mirrored(self.mirror, self._at(slot.index, j), old, 1)
        except DriverError as undo:
            self.mark_torn(slot, j, 1)
            raise TornMirror(f"copy-on-write of slot {slot.index} page {j} failed ({exc}) and mapping the shared page "
                             f"back failed too ({undo}): the slot lists a page that is not mapped; close the cache"
                             ) from exc

    def mark_torn(self, slot: Slot, first: int, count: int) -> None:
        self.torn.update((slot.index, j) for j in range(first, first + count))
        self.counters.torn_pages = len(self.torn)

    def first_torn(self, slot: Slot) -> int | None:
        return min((j for s, j in self.torn if s == slot.index), default=None)


def group_runs(groups: list[int]) -> list[tuple[int, int]]:
    """(index, length) runs of consecutive group ids (each run is one map call per tensor)."""
    out: list[tuple[int, int]] = []
    for i, g in enumerate(groups):
        if out and groups[out[-1][0]] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
