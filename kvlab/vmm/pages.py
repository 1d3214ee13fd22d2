"""The pages room of the vmm cache: its books (the free list, vmm/free_pages.py; the slot rows, vmm/slots.py) and
the moves of page groups between them (`SlotPages`). A move is booked first (groups taken, tails reclaimed,
vmm/reclaim.py; the slot's list and held tokens), then its driver side goes to the memory room in one batch
(`Moves`, `VirtualMemory.apply`: pool pages held, tails unmapped, new runs mapped; one mirrored call per run of
consecutive groups maps a page in all 2L tensors at once). Page j of slot s sits at s * row_bytes + j * page_size
in every tensor.

A slot grows by taking groups from the free list (contiguous after its last page when possible); a fork child maps
its parent's groups (shared, copy-on-write); a write to a shared page first gives the writer its own copy.

Every change is all or nothing: if the driver stops part way, the books are put back to what it did (tails it did
not unmap are listed again, groups it did not map go back to the free list), so a DriverError leaves slots, free
list and mappings agreeing. Only if an undo fails too (`TornMirror`) does a slot list a page that is not mapped in
every tensor; such pages are remembered (`torn`) and cleared, not unmapped, later; check_invariants reports them,
and the cache must be closed. A copy-on-write remaps the page and orders the storage to copy its bytes (`CopyKV`,
common/kv/types.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlab.common.errors import DriverError
from kvlab.common.kv.types import CopyKV
from kvlab.vmm.drivers.types import Moves, TornMirror
from kvlab.vmm.free_pages import PageCounters
from kvlab.vmm.page_calls import PageCalls, mapped_groups, spots
from kvlab.vmm.reclaim import Reclaim
from kvlab.vmm.slots import DROPPED

if TYPE_CHECKING:
    from kvlab.common.kv.types import MoveSink
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.drivers.types import Mirror
    from kvlab.vmm.free_pages import FreePages
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.reclaim import Reclaimed
    from kvlab.vmm.slots import Slot, SlotTable

log = logging.getLogger("kvlab.vmm")


class SlotPages:
    """Moves of page groups: booked here, carried out by the driver in one batch each."""

    def __init__(self, geo: Geometry, driver: VirtualMemory, mirror: Mirror, free_pages: FreePages,
                 table: SlotTable, put_off: bool = False) -> None:
        self.geo, self.driver, self.mirror, self.free_pages, self.table = geo, driver, mirror, free_pages, table
        self.counters = PageCounters()
        # With `put_off` (background mapping) a freed slot's tail is reclaimed only as far as needed: its unmaps are
        # off the step anyway, and the pages it keeps parked save a later admission its maps, which are on the step.
        self.reclaim = Reclaim(geo, free_pages, table, self.counters, whole_tails=driver.unmaps_runs and not put_off)
        self.calls = PageCalls(geo, driver, mirror, put_off)   # the driver side: batches, addresses, torn pages

    def shared_pages(self, slot: Slot, start: int, end: int) -> list[int]:
        """Pages of `slot` that writes to positions [start, end) touch and another slot also maps."""
        if not self.free_pages.num_shared:   # no fork shares a page: the per-step path stops here
            return []
        last = min(self.geo.pages_for(end), len(slot.groups))
        first = max(start // self.geo.tokens_per_page, slot.dropped)   # never below the window's unmapped pages
        return [j for j in range(first, last) if self.free_pages.is_shared(slot.groups[j])]

    # -- growing a slot ---------------------------------------------------------------------------------
    def grow(self, slot: Slot, start: int, tokens: int, emit: MoveSink) -> None:
        """The slot's owner will write positions [start, tokens): the shared pages those writes touch are copied
        (copy-on-write), the missing pages mapped, and the slot holds `tokens`. On a machine-wide pool the pool
        pages of all these maps are held first, in one ledger step: a refusal comes before anything changed, and it
        asks the other engines for the growth's whole shortfall at once."""
        pages, free = self.geo.pages_for(tokens), self.free_pages
        shared = self.shared_pages(slot, start, tokens)
        unbacked = min(max(0, pages - len(slot.groups)) + len(shared), free.num_free)   # parked, cached: backed
        hold = unbacked * self.geo.num_tensors
        if shared:   # forks only: each copy is a remap of its own, after the hold
            if hold:
                self.driver.apply(self.mirror, Moves(hold=hold))
            hold = 0
            self.copy_on_write(slot, shared, pages, emit)
        self.extend(slot, pages, hold, tokens)

    def extend(self, slot: Slot, pages: int, hold: int = 0, tokens: int = 0) -> None:
        """Map the slot up to `pages` pages and let its owner write `tokens` (`hold`: pool pages to hold first):
        booked first (tails reclaimed, groups taken and listed, tokens held), then carried out in one batch."""
        first, held, calls = len(slot.groups), slot.held, self.calls
        if pages <= first:
            if tokens > held:
                self.table.hold(slot, tokens)
            return
        new, reclaimed = self.reclaim.obtain(pages - first, slot, keep=pages, prefer=_after_last(slot))
        with self.table.accounting(slot):
            slot.groups.extend(new)
        self.free_pages.own(new)
        if tokens > held:
            self.table.hold(slot, tokens)
        # Background mapping: the reclaimed pages stay mapped at their old place until the mapper's next job unmaps
        # them, during the forward pass; the new place maps them now. No slot lists the old place: nothing reads it.
        put_off = calls.putting_off and reclaimed
        self._carry_out(calls.moves([] if put_off else reclaimed, slot, first, new, hold), reclaimed, slot, first, held)
        if put_off:
            calls.put_off_tails(spots(reclaimed))

    def map_ahead(self, index: int, seq_id: int, target: int) -> bool:
        """Map pages the slot will need soon, from the free list and parked pages of freed slots (never pages a
        live slot maps). False if nothing was mapped."""
        slot, free = self.table.slots[index], self.free_pages
        if slot.seq_id != seq_id or len(slot.groups) >= target:
            return False
        reclaimed: list[Reclaimed] = []
        if free.num_free < target - len(slot.groups):   # parked pages of freed slots: anyone's
            self.reclaim.stale(target - len(slot.groups) - free.num_free, reclaimed)
        count, first = min(target - len(slot.groups), free.num_free), len(slot.groups)
        if count <= 0:
            self.counters.lookahead_skipped += 1
            log.debug("background mapping skipped for slot %d: no page group is free", index)
            return False
        new = free.take(count, _after_last(slot))
        with self.table.accounting(slot):
            slot.groups.extend(new)
        free.own(new)
        self._carry_out(self.calls.moves(reclaimed, slot, first, new), reclaimed, slot, first, slot.held)
        self.counters.lookahead_pages += count
        return True

    def _carry_out(self, moves: Moves, reclaimed: list[Reclaimed], slot: Slot, first: int, held: int) -> None:
        """Carry out `moves` (PageCalls.moves); on failure put the books back to what the driver did: the groups
        listed after page `first` of `slot` that it did not map, `held` tokens, the tails it did not unmap."""
        try:
            if self.calls.put_off:   # unmaps put off in this row run before it maps there again
                self.calls.flush(slot.index)
            self.driver.apply(self.mirror, moves)
        except BaseException:
            self.calls.mark_torn(moves, spots(reclaimed), slot.index, first)
            kept = first + mapped_groups(moves)
            lost = slot.groups[kept:]
            if slot.held != held:
                self.table.hold(slot, held)
            with self.table.accounting(slot):
                del slot.groups[kept:]
            self.free_pages.unown(lost)   # before the tails are listed again: a reclaimed group may be among them
            self.reclaim.relist(reclaimed[moves.unmapped:])
            raise
        if moves.clear:
            self.calls.cleared(moves, spots(reclaimed))

    # -- copy-on-write ------------------------------------------------------------------------------------
    def copy_on_write(self, slot: Slot, shared: list[int], keep: int, emit: MoveSink) -> None:
        """Give the slot its own copy of each of its `shared` pages; each copy all or nothing: remapped, then its
        bytes copied by the storage from a slot that still maps the shared page (at the same page index)."""
        for j in shared:
            old = slot.groups[j]
            prefer = slot.groups[j - 1] + 1 if j else None
            (new,), reclaimed = self.reclaim.obtain(1, slot, keep=keep, prefer=prefer)
            self._remap(slot, j, old, new, reclaimed)
            source = next(s.index for s in self.table.slots if len(s.groups) > j and s.groups[j] == old)
            emit(CopyKV((source, j), (slot.index, j), self.geo.tokens_per_page))   # a slot still mapping `old`
            self.counters.cow_copies += 1

    def _remap(self, slot: Slot, j: int, old: int, new: int, reclaimed: list[Reclaimed]) -> None:
        """Group `new` (just taken) at page j in place of the shared `old`, after the reclaimed tails' unmaps. A
        failure gives `new` back and leaves `old` mapped; if mapping `old` back fails too: TornMirror."""
        moves = self.calls.moves(reclaimed, slot, j, [new])
        moves.unmaps.append((self.calls.at(slot.index, j), 1))
        try:
            self.calls.apply(moves, [*spots(reclaimed), (slot.index, j, 1)], slot.index, j)
        except BaseException as exc:
            if moves.mapped:   # a TornMirror mapping the copy: the slot lists it, partly mapped
                self._take_copy(slot, j, old, new)
                raise
            self.free_pages.return_untaken([new])
            self.reclaim.relist(reclaimed[moves.unmapped:])
            if moves.unmapped == len(moves.unmaps):   # `old` was unmapped: map it back
                self._map_back(slot, j, old, exc)
            raise
        self._take_copy(slot, j, old, new)

    def _take_copy(self, slot: Slot, j: int, old: int, new: int) -> None:
        self.free_pages.unshare(old)
        slot.groups[j] = new
        self.free_pages.own([new])

    def _map_back(self, slot: Slot, j: int, old: int, exc: BaseException) -> None:
        """Map the shared group `old` back at page j after its copy failed to map."""
        try:
            self.driver.apply(self.mirror, Moves(maps=[(self.calls.at(slot.index, j), old, 1)]))
        except DriverError as undo:
            self.calls.torn_run(slot.index, j, 1)
            raise TornMirror(f"copy-on-write of slot {slot.index} page {j} failed ({exc}) and mapping the shared page "
                             f"back failed too ({undo}): the slot lists a page that is not mapped; close the cache"
                             ) from exc

    # -- filling a just-claimed slot -----------------------------------------------------------------------
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

    def fill_with(self, slot: Slot, count: int, tokens: int, back: Callable[[list[int]], None]) -> None:
        """Fill a just-claimed slot (its stale pages go) with `count` groups that `back` gives their memory before
        they are mapped (a handoff's received pages); the slot holds `tokens`."""
        self.drop_all(slot)
        groups, reclaimed = self.reclaim.obtain(count, slot, keep=count, prefer=None)
        moves = self.calls.moves(reclaimed, slot, 0, [])
        try:
            self.calls.apply(moves, spots(reclaimed))   # the tails go before their groups are backed anew
            back(groups)
        except BaseException:
            self.free_pages.return_untaken(groups)
            self.reclaim.relist(reclaimed[moves.unmapped:])
            raise
        with self.table.accounting(slot):
            self._append(slot, groups, shared=False)
            slot.held = tokens

    def _append(self, slot: Slot, groups: list[int], shared: bool) -> None:
        """Map `groups` after the slot's last page and list them: owned (fresh from the free list) or shared (a
        fork, a prefix hit). A failure lists only what stays mapped; fresh groups not mapped go back. Call in
        accounting."""
        moves = self.calls.moves([], slot, len(slot.groups), groups)
        try:
            if self.calls.put_off:   # unmaps put off in this row run before it maps there again
                self.calls.flush(slot.index)
            self.calls.apply(moves, [], slot.index, len(slot.groups))
        finally:
            kept = groups[:mapped_groups(moves)]
            slot.groups.extend(kept)
            if shared:
                self.free_pages.share(kept)
            else:
                self.free_pages.own(kept)
                self.free_pages.return_untaken(groups[len(kept):])

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

    # -- giving pages up -----------------------------------------------------------------------------------
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
        if self.calls.torn:
            drop = min((j for j in (drop, self.calls.first_torn(slot.index)) if j is not None), default=None)
        if drop is not None:   # keep the prefix before it only: a free slot never holds a shared or torn page
            with self.table.accounting(slot):
                self.drop_tail(slot, len(slot.groups) - drop)
        self.table.vacate(slot)

    def drop_all(self, slot: Slot) -> None:
        """Unmap every page the slot maps (all or nothing) and put their groups back."""
        with self.table.accounting(slot):
            self.drop_tail(slot, len(slot.groups))

    def drop_tail(self, slot: Slot, count: int) -> None:
        """Unmap the slot's last `count` pages (all or nothing) and put their groups back."""
        if count <= 0:
            return
        first = len(slot.groups) - count
        self.calls.unmap(slot.index, first, count)
        self.free_pages.put_back(slot.groups[first:])
        del slot.groups[first:]

    def drop_below(self, slot: Slot, end: int) -> None:
        """Sliding window: unmap the slot's pages [dropped, end) in every tensor (one mirrored call; no kernel reads
        them again) and give their groups back (a group a fork shares stays mapped in the other slots). The list
        keeps DROPPED in their place, so page j still sits at index j. Held tokens and reclaimable pages are
        unchanged: no accounting context needed."""
        first, count = slot.dropped, end - slot.dropped
        if count <= 0:
            return
        self.calls.unmap(slot.index, first, count)
        self.free_pages.put_back(slot.groups[first:end])
        slot.groups[first:end] = [DROPPED] * count
        slot.dropped = end
        self.counters.window_dropped_pages += count


def _after_last(slot: Slot) -> int | None:
    """The group right after the slot's last one: taking it keeps the mapping contiguous."""
    return slot.groups[-1] + 1 if slot.groups else None
