"""Growing a sequence's slot to hold a token count: what that costs in page groups, and getting them (a slot
claimed with its prefix hits aliased in, shared pages copied before a write, pages below a sliding window
unmapped, new pages mapped, retried once after unmapping parked pages when the OS mappings run out).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.vmm.drivers.map_budget import MapBudgetExhausted

if TYPE_CHECKING:
    from kvlab.common.kv.types import MoveSink
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.aliases import PrefixAliases
    from kvlab.vmm.drivers.machine_pool import MachinePool
    from kvlab.vmm.pages import SlotPages
    from kvlab.vmm.slots import Slot
    from kvlab.vmm.swap import SwapSpace


class SlotGrowth:
    """`window`: the model's sliding window (None: full attention, no page is ever unmapped below it)."""

    def __init__(self, pages: SlotPages, prefix: PrefixAliases | None, swap: SwapSpace, window: int | None,
                 pool: MachinePool) -> None:
        self.pages, self.prefix, self.swap, self.window, self.pool = pages, prefix, swap, window, pool
        self.geo, self.table, self.free_pages = pages.geo, pages.table, pages.free_pages

    # -- cost -----------------------------------------------------------------------------------------------
    def free_units(self) -> int:
        """Free groups, reclaimable mapped ones and idle cached ones: all can be taken."""
        return self.free_pages.num_free + self.table.excess + self.free_pages.num_idle()

    def available_units(self) -> int:
        """What can be taken now: free units, the unmapped ones only as far as the machine-wide pool can back them
        (other engines hold the rest; with no pool its room is unbounded)."""
        free = self.free_pages
        return self.table.excess + free.num_idle() + min(free.num_free, self.pool.room_pages() // self.geo.num_tensors)

    def fits(self, seq: Sequence, num_tokens: int, reserve_units: int) -> bool:
        """Whether growing to `num_tokens` leaves `reserve_units` free (asked for every running sequence every
        step: no scans)."""
        if num_tokens > self.geo.max_len:
            return False
        index = self.table.slot_of.get(seq.seq_id)
        if index is None:
            if not self.table.has_free():
                return False
            need = self.units_to_admit(seq, num_tokens)
        else:
            need = self.units_to_grow(self.table.slots[index], seq, num_tokens)
        return need + reserve_units <= self.available_units()

    def units_to_admit(self, seq: Sequence, num_tokens: int) -> int:
        """Pages a first allocation takes: prefix hits mapped in another slot cost nothing, idle ones a unit."""
        need = self.geo.pages_for(num_tokens)
        saved = self.swap.swapped.get(seq.seq_id)
        if saved is not None:   # swap_in restores its own pages (no aliasing), none below its window
            return need - saved.dropped
        if self.prefix is None:
            return need
        return self.prefix.units_to_admit(seq, num_tokens, need)

    def units_to_grow(self, slot: Slot, seq: Sequence, num_tokens: int) -> int:
        tpp = self.geo.tokens_per_page
        grow = -(-num_tokens // tpp) + slot.held // -tpp   # pages for num_tokens - pages for the held tokens
        if self.free_pages.num_shared:
            return max(0, grow) + len(self.pages.shared_pages(slot, seq.num_computed_tokens, num_tokens))
        return max(0, grow)

    # -- growth ---------------------------------------------------------------------------------------------
    def in_place(self, slot: Slot | None, num_tokens: int) -> bool:
        """The one fast path (a decode step's): the slot's mapped pages already cover `num_tokens` and none is
        shared (no copy-on-write due), so the slot only holds more of them. False: take the full path."""
        if slot is None or self.free_pages.num_shared or self.geo.pages_for(num_tokens) > len(slot.groups):
            return False
        if num_tokens > slot.held:
            self.table.hold(slot, num_tokens)
        return True

    def grow(self, seq: Sequence, num_tokens: int, emit: MoveSink) -> int | None:
        """Make the sequence hold `num_tokens`; returns the prefix-hit tokens, or None when out of OS mappings."""
        slot = self.table.of(seq.seq_id)
        if slot is not None and self.prefix is not None:
            self.prefix.register(seq, slot)
        if slot is not None and self.window is not None:
            self._drop_below_window(slot, seq.num_computed_tokens)
        if self.in_place(slot, num_tokens):
            return 0
        return self._in_map_budget(seq, slot, num_tokens, emit)

    def _drop_below_window(self, slot: Slot, computed: int) -> None:
        """Sliding window: this step's queries start at `computed` (later steps' further on), so they read keys from
        computed - W + 1 on; pages wholly below that are unmapped and their groups freed. A sequence then maps at
        most ceil(W / tokens_per_page) + 1 pages during decode."""
        first_needed = max(min(computed, slot.held) - self.window + 1, 0)
        end = min(first_needed // self.geo.tokens_per_page, len(slot.groups))
        if end > slot.dropped:
            self.pages.drop_below(slot, end)

    def _in_map_budget(self, seq: Sequence, slot: Slot | None, num_tokens: int, emit: MoveSink) -> int | None:
        """`_grow`; out of OS mappings (MapBudgetExhausted, logged and counted), unmap the parked pages of freed
        slots, which gives their mappings back, and try once more; still out: None, nothing changed (out of room,
        like out of KV)."""
        try:
            return self._grow(seq, slot, num_tokens, emit)
        except MapBudgetExhausted:
            if not self.table.stale:
                return None
        self.drop_stale()
        try:
            return self._grow(seq, self.table.of(seq.seq_id), num_tokens, emit)
        except MapBudgetExhausted:
            return None

    def drop_stale(self) -> None:
        """Unmap the parked pages of freed slots (kept for reuse): their mappings and memory go back."""
        for index in list(self.table.stale):
            self.pages.drop_all(self.table.slots[index])

    def _grow(self, seq: Sequence, slot: Slot | None, num_tokens: int, emit: MoveSink) -> int:
        claimed, hit = slot is None, 0
        if claimed:
            slot, hit = self._claim(seq, num_tokens)
        try:
            self._hold(slot, seq, max(seq.num_computed_tokens, hit), num_tokens)
            self.pages.copy_on_write(slot, max(seq.num_computed_tokens, hit), num_tokens, emit)   # hits: not written
            self.pages.grow(slot, self.geo.pages_for(num_tokens))
        except BaseException:
            if claimed:   # a failed first allocation leaves the sequence holding nothing
                if self.prefix is not None:
                    self.prefix.forget(seq.seq_id)
                self.pages.release(slot)
            raise
        self.table.hold(slot, max(slot.held, num_tokens))
        return hit

    def _hold(self, slot: Slot, seq: Sequence, start: int, num_tokens: int) -> None:
        """A machine-wide pool: take the pool pages of every map this growth makes (copies, new groups, each in
        every tensor: one driver call per tensor) in one ledger step before the first. A refusal then comes before
        anything changed, and it asks the other engines for the growth's whole shortfall at once, not for one
        tensor's page (its one wait in the step got that page, and the next tensor's map was refused)."""
        new = max(0, self.geo.pages_for(num_tokens) - len(slot.groups))
        new += len(self.pages.shared_pages(slot, start, num_tokens))
        unmapped = min(new, self.free_pages.num_free)   # the others come from parked or cached groups: already backed
        if unmapped:
            self.pool.hold(unmapped * self.geo.num_tensors)

    def retire(self, seq: Sequence, slot: Slot) -> None:
        """The sequence gives its slot up (freed, swapped out): its computed pages stay findable (prefix caching)."""
        if self.prefix is not None:
            self.prefix.register(seq, slot)
            self.prefix.forget(seq.seq_id)
        self.pages.release(slot)

    def _claim(self, seq: Sequence, num_tokens: int) -> tuple[Slot, int]:
        """A slot for a first allocation (with its cached prefix pages aliased in); returns it and the hit tokens."""
        if self.prefix is None:
            return self.table.claim(seq.seq_id, num_tokens), 0
        return self.prefix.claim(seq, num_tokens)

    def map_ahead(self, index: int, seq_id: int, target: int) -> bool:
        """The background mapper's job: mapping ahead is skipped, not failed, when the OS mappings are spent."""
        try:
            return self.pages.map_ahead(index, seq_id, target)
        except MapBudgetExhausted:
            self.pages.counters.lookahead_skipped += 1
            return False
