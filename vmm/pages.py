"""The pages of the vmm cache: which page groups are in the pool and how many slots map each (`PagePool`), and
moving them between the pool and slot rows, mapped in every tensor through the driver (`SlotPages`), with the
counters those moves keep (`PageCounters`).

Group g is pool page t*G + g of tensor t, so groups with consecutive ids are consecutive pool pages in every
tensor: taking runs of consecutive groups lets neighbouring mappings merge (host VMAs).

A slot grows by taking groups from the pool (contiguous after its last page when possible); a fork child maps
its parent's groups (shared, copy-on-write); a write to a shared page first gives the writer its own copy.
When the pool runs short, pages no live token needs are reclaimed: parked pages of the oldest freed slots
first, then pages mapped ahead in live slots.

Every change is all or nothing: the driver's mirrored calls undo their own partial work, and a failed step here
undoes the steps before it (groups taken from the pool go back), so a DriverError leaves slots, pool and
mappings as they were. Only if an undo fails too (`TornMirror`) does a slot list a page that is not mapped in
every tensor; check_invariants reports it, and the cache must be closed.
"""
from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.common.errors import DriverError, OutOfKVCache
from kvlab.vmm.drivers.types import Mirror, TornMirror
from kvlab.vmm.slots import DROPPED

if TYPE_CHECKING:
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.prefix import PagePrefixCache
    from kvlab.vmm.slots import Slot, SlotTable
    from kvlab.vmm.views import PageData

log = logging.getLogger("kvlab.vmm")


@dataclass(slots=True)
class PageCounters:
    cow_copies: int = 0            # shared pages copied for a writer
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    reclaimed_units: int = 0       # pages unmapped to make room (stale slots, pages mapped ahead)
    lookahead_pages: int = 0       # pages the background mapper mapped ahead of need
    lookahead_skipped: int = 0     # background jobs that found the pool empty
    torn_pages: int = 0            # pages waiting to be cleared after a TornMirror
    window_dropped_pages: int = 0  # page groups unmapped below a sliding window (back to the pool)


class PagePool:
    """Free flags and per-group slot counts (forks and prefix hits share groups copy-on-write). With a prefix
    cache, a cached group no slot maps is neither free nor mapped: it is idle in the cache until evicted."""

    def __init__(self, num_groups: int, cache: PagePrefixCache | None = None) -> None:
        self.num_groups, self.cache = num_groups, cache
        self.free = bytearray(b"\x01") * num_groups   # 1 = group in the pool, unmapped
        self.num_free = num_groups
        self.refs = array("i", [0]) * num_groups      # slots mapping each group
        self.num_shared = 0                           # groups more than one slot maps (0: no copy-on-write)

    def take(self, count: int, prefer: int | None) -> list[int]:
        """Prefer the groups right after `prefer`, then the first run of `count` free groups, then any."""
        taken: list[int] = []

        def take(g: int) -> None:
            self.free[g] = 0
            taken.append(g)
        g = prefer if prefer is not None else self.num_groups
        while len(taken) < count and g < self.num_groups and self.free[g]:
            take(g)
            g += 1
        rest = count - len(taken)
        start = self.free.find(b"\x01" * rest) if rest else -1
        for g in range(start, start + rest) if start >= 0 else ():
            take(g)
        while len(taken) < count:
            take(self.free.find(b"\x01"))
        self.num_free -= count
        return taken

    def own(self, groups: Iterable[int]) -> None:
        """Groups just taken are now mapped by one slot."""
        for g in groups:
            self.refs[g] = 1

    def share(self, groups: Iterable[int]) -> None:
        """One slot more maps each group (a fork child, or a prefix hit: an idle cached group leaves the LRU)."""
        refs = self.refs
        for g in groups:
            if refs[g] == 0:
                self.cache.unpark(g)
            refs[g] += 1
            self.num_shared += refs[g] == 2

    def unshare(self, g: int) -> None:
        """A slot stops mapping a shared group; the other slots still map it."""
        self.refs[g] -= 1
        self.num_shared -= self.refs[g] == 1

    def is_shared(self, g: int) -> bool:
        return self.refs[g] > 1

    def put_back(self, groups: list[int]) -> None:
        """One slot fewer maps each group; a group no slot maps returns to the pool, or, if cached, idles in the
        cache's LRU (last pages first, so a chain's tail is evicted before its head)."""
        refs, cache = self.refs, self.cache
        for g in reversed(groups):
            refs[g] -= 1
            if refs[g] == 0:
                if cache is not None and cache.is_cached(g):
                    cache.park(g)
                    continue
                self.free[g] = 1
                self.num_free += 1
            elif refs[g] == 1:
                self.num_shared -= 1

    def num_idle(self) -> int:
        """Cached groups no slot maps: free capacity once evicted."""
        return len(self.cache.idle) if self.cache is not None else 0

    def is_cached(self, g: int) -> bool:
        return self.cache is not None and self.cache.is_cached(g)

    def evict(self, count: int) -> int:
        """Return up to `count` idle cached groups to the pool, least recently used first (whole groups)."""
        if self.cache is None:
            return 0
        groups = self.cache.evict(count)
        for g in groups:
            self.free[g] = 1
        self.num_free += len(groups)
        return len(groups)

    def return_untaken(self, groups: Iterable[int]) -> None:
        """After a failed mapping: groups taken but never owned go back to the pool."""
        for g in groups:
            if self.refs[g] == 0 and not self.free[g] and not self.is_cached(g):
                self.free[g] = 1
                self.num_free += 1

    def check(self, slots: list[Slot]) -> None:
        refs = [0] * self.num_groups
        for slot in slots:
            groups = slot.live_groups()
            assert len(set(groups)) == len(groups), f"slot {slot.index} maps a group twice"
            for g in groups:
                refs[g] += 1
        assert list(self.refs) == refs, "page refcounts differ from the slots mapping them"
        for g in range(self.num_groups):
            assert bool(self.free[g]) == (refs[g] == 0 and not self.is_cached(g)), \
                f"group {g}: free flag and mappings disagree"
        if self.cache is not None:
            self.cache.check(refs)
        assert self.num_free == sum(self.free), "free-page count drifted"
        assert self.num_shared == sum(1 for r in refs if r > 1), "shared-page count drifted"


class SlotPages:
    """Moves of page groups; every map and unmap is one mirrored driver call for all 2L tensors."""

    def __init__(self, geo: Geometry, driver: VirtualMemory, mirror: Mirror, data: PageData, pool: PagePool,
                 table: SlotTable) -> None:
        self.geo, self.driver, self.mirror, self.data = geo, driver, mirror, data
        self.pool, self.table = pool, table
        self.counters = PageCounters()
        self.torn: set[tuple[int, int]] = set()   # (slot, page) maybe not mapped alike in every tensor (TornMirror)
        self._row_bytes, self._page_size = geo.row_bytes, geo.page_size

    def _at(self, slot: int, page: int) -> int:
        """Where page `page` of slot `slot` sits inside each tensor."""
        return slot * self._row_bytes + page * self._page_size

    def shared_pages(self, slot: Slot, start: int, end: int) -> list[int]:
        """Pages of `slot` that writes to positions [start, end) touch and another slot also maps."""
        if not self.pool.num_shared:   # no fork shares a page: the per-step path stops here
            return []
        last = min(self.geo.pages_for(end), len(slot.groups))
        first = max(start // self.geo.tokens_per_page, slot.dropped)   # never below the window's unmapped pages
        return [j for j in range(first, last) if self.pool.is_shared(slot.groups[j])]

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
            self.counters.lookahead_skipped += 1
            log.debug("background mapping skipped for slot %d: the pool is empty", index)
            return False
        self._extend(slot, self.pool.take(count, _after_last(slot)))
        self.counters.lookahead_pages += count
        return True

    def alias(self, slot: Slot, groups: list[int], tokens: int) -> None:
        """Map cached groups (a prefix hit) at pages 0.. of a just-claimed slot; its stale pages go back first."""
        with self.table.accounting(slot):
            self.drop_tail(slot, len(slot.groups))
            self._append(slot, groups, shared=True)
            slot.held = tokens

    def share(self, source: Slot, target: Slot) -> None:
        """Map the source's live pages into a just-claimed target (a fork child) at the same pages (below the
        source's window too: none); the target's stale pages go back."""
        shared = source.groups[source.dropped:self.geo.pages_for(source.held)]
        with self.table.accounting(target):
            self.open_window(target, source.dropped)
            self._append(target, shared, shared=True)
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
        self._unmap_pages(slot, first, end)
        self.pool.put_back(slot.groups[first:end])
        slot.groups[first:end] = [DROPPED] * count
        slot.dropped = end
        self.counters.window_dropped_pages += count

    def copy_on_write(self, slot: Slot, start: int, end: int) -> None:
        """Give the slot its own copy of each shared page the writes touch; each copy all or nothing."""
        for j in self.shared_pages(slot, start, end):
            old = slot.groups[j]
            prefer = slot.groups[j - 1] + 1 if j else None
            new = self._obtain(1, slot, keep=self.geo.pages_for(end), prefer=prefer)[0]
            try:
                saved = self.data.save_page(slot.index, j)
                self.driver.unmap_mirrored(self.mirror, self._at(slot.index, j), 1)
            except BaseException as exc:
                self.pool.return_untaken([new])   # the slot still lists `old`
                if isinstance(exc, TornMirror):
                    self._mark_torn(slot, j, 1)
                raise
            try:
                self.driver.map_mirrored(self.mirror, self._at(slot.index, j), new, 1)
            except TornMirror:
                self._take_copy(slot, j, old, new)   # partly mapped: the slot lists the copy
                self._mark_torn(slot, j, 1)
                raise
            except BaseException as exc:
                self.pool.return_untaken([new])
                self._map_back(slot, j, old, exc)
                raise
            self._take_copy(slot, j, old, new)
            self.data.restore_page(slot.index, j, saved)
            self.counters.cow_copies += 1

    def _take_copy(self, slot: Slot, j: int, old: int, new: int) -> None:
        self.pool.unshare(old)
        slot.groups[j] = new
        self.pool.own([new])

    def _map_back(self, slot: Slot, j: int, old: int, exc: BaseException) -> None:
        """Map the shared page `old` back at page j after its copy failed to map."""
        try:
            self.driver.map_mirrored(self.mirror, self._at(slot.index, j), old, 1)
        except DriverError as undo:
            self._mark_torn(slot, j, 1)
            raise TornMirror(f"copy-on-write of slot {slot.index} page {j} failed ({exc}) and mapping the shared page "
                             f"back failed too ({undo}): the slot lists a page that is not mapped; close the cache"
                             ) from exc

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
        if self.pool.num_shared or self.pool.cache is not None:   # a free slot never maps a cached page either
            drop = next((j for j, g in enumerate(slot.groups) if self.pool.is_shared(g) or self.pool.is_cached(g)),
                        None)
        if self.torn:
            drop = min([j for s, j in self.torn if s == slot.index] + ([] if drop is None else [drop]), default=None)
        if drop is not None:   # keep the prefix before it only: a free slot never holds a shared or torn page
            with self.table.accounting(slot):
                self.drop_tail(slot, len(slot.groups) - drop)
        self.table.vacate(slot)

    def drop_tail(self, slot: Slot, count: int) -> None:
        """Unmap the slot's last `count` pages (all or nothing) and put their groups back."""
        if count <= 0:
            return
        first, end = len(slot.groups) - count, len(slot.groups)
        self._unmap_pages(slot, first, end)
        self.pool.put_back(slot.groups[first:])
        del slot.groups[first:]

    def _unmap_pages(self, slot: Slot, first: int, end: int) -> None:
        """Unmap pages [first, end) of the slot in every tensor, all or nothing (a torn page is cleared instead)."""
        count = end - first
        torn = [(slot.index, j) for j in range(first, end) if (slot.index, j) in self.torn] if self.torn else []
        try:
            if torn:
                self.driver.clear_mirrored(self.mirror, self._at(slot.index, first), count)
            else:
                self.driver.unmap_mirrored(self.mirror, self._at(slot.index, first), count)
        except TornMirror:
            self._mark_torn(slot, first, count)
            raise
        if torn:
            self.torn.difference_update(torn)
            self.counters.torn_pages = len(self.torn)

    def _mark_torn(self, slot: Slot, first: int, count: int) -> None:
        self.torn.update((slot.index, j) for j in range(first, first + count))
        self.counters.torn_pages = len(self.torn)

    # -- taking from the pool -----------------------------------------------------------------------------
    def _extend(self, slot: Slot, new: list[int]) -> None:
        with self.table.accounting(slot):
            self._append(slot, new, shared=False)

    def _obtain(self, count: int, requester: Slot, keep: int, prefer: int | None) -> list[int]:
        """`count` groups from the pool, reclaiming pages no live token needs when the pool runs short."""
        if self.pool.num_free < count:
            self._reclaim(count - self.pool.num_free, requester, keep)
        if self.pool.num_free < count:   # idle cached pages are evicted last, whole groups, oldest first
            self.pool.evict(count - self.pool.num_free)
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
            self.counters.reclaimed_units += n
        return max(n, 0)

    # -- driver calls -------------------------------------------------------------------------------------
    def _append(self, slot: Slot, groups: list[int], shared: bool) -> None:
        """Map `groups` after the slot's last page in every tensor (one call per run) and list them: owned (fresh
        from the pool) or shared (a fork). All or nothing: a failure unmaps the runs mapped so far and gives fresh
        groups back to the pool. Should an undo fail too, what is still (partly) mapped stays listed."""
        first, mapped = len(slot.groups), 0
        try:
            for start, n in group_runs(groups):
                mapped = start + n
                self.driver.map_mirrored(self.mirror, self._at(slot.index, first + start), groups[start], n)
        except TornMirror:
            self._mark_torn(slot, first + start, n)
            raise
        except BaseException:
            mapped = start   # the failed run left nothing mapped
            mapped = self._unmap_back(slot, first, groups, mapped)
            raise
        finally:
            kept = groups[:mapped]
            slot.groups.extend(kept)
            if shared:
                self.pool.share(kept)
            else:
                self.pool.own(kept)
                self.pool.return_untaken(groups[mapped:])

    def _unmap_back(self, slot: Slot, first: int, groups: list[int], mapped: int) -> int:
        """Unmap the runs of groups[:mapped] (mapped at pages first..), last first; returns how many groups stay
        mapped (all up to the run whose unmap failed)."""
        for start, n in reversed(group_runs(groups[:mapped])):
            try:
                self.driver.unmap_mirrored(self.mirror, self._at(slot.index, first + start), n)
            except DriverError as exc:
                if isinstance(exc, TornMirror):
                    self._mark_torn(slot, first + start, n)
                log.error("vmm: undoing a failed map of slot %d failed too (%s); pages %d..%d stay mapped and listed",
                          slot.index, exc, first, first + start + n - 1)
                return start + n
        return 0


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
