"""Swapping on the vmm allocator: the books of the sequences swapped out, and the orders that move their K/V
(common/kv/types.py): saved to the host before the slot's pages go, written back once a slot maps them again,
dropped if the sequence is freed while out. The storage carries the orders out; with none, nothing moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvlab.common.kv.types import DropSavedKV, MoveSink, RestoreKV, SaveKV
from kvlab.vmm.drivers.map_budget import MapBudgetExhausted

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.pages import SlotPages
    from kvlab.vmm.slots import Slot


@dataclass(slots=True)
class SwappedKV:
    tokens: int
    dropped: int = 0              # leading pages the sliding window had unmapped: not saved, not mapped back


class SwapSpace:
    """Sequence id -> what it held when swapped out. Orders address (slot, first token saved)."""

    def __init__(self, pages: SlotPages, bytes_per_token: int) -> None:
        self.pages, self.geo, self.bytes_per_token = pages, pages.geo, bytes_per_token
        self.swapped: dict[int, SwappedKV] = {}

    def save(self, seq: Sequence, slot: Slot, emit: MoveSink) -> None:
        """Book the sequence's computed tokens as out and order their host copy (its slot is released next)."""
        tokens = min(seq.num_computed_tokens, slot.held)
        saved = SwappedKV(tokens, min(slot.dropped, self.geo.pages_for(tokens)))   # only the window's pages
        start = self._start(saved)
        emit(SaveKV(seq.seq_id, (slot.index, start), tokens - start))
        self.swapped[seq.seq_id] = saved
        self.pages.counters.swapped_out_bytes += (tokens - start) * self.bytes_per_token

    def restore(self, seq: Sequence, emit: MoveSink) -> bool:
        """Map a slot for the saved tokens and order them written back; False (nothing changed) when out of OS
        mappings, which is out of room (logged, counted)."""
        saved = self.swapped[seq.seq_id]
        try:
            slot = self.pages.new_slot(seq.seq_id, saved.tokens, partial(self._map, saved),
                                       fewest_pages=bool(saved.dropped))
        except MapBudgetExhausted:
            return False
        self.pages.table.hold(slot, saved.tokens)
        start = self._start(saved)
        emit(RestoreKV(seq.seq_id, (slot.index, start), saved.tokens - start))
        del self.swapped[seq.seq_id]
        self.pages.counters.swapped_in_bytes += (saved.tokens - start) * self.bytes_per_token
        return True

    def drop(self, seq_id: int, emit: MoveSink) -> None:
        """A sequence is freed: if it was out, its host copy goes."""
        if self.swapped.pop(seq_id, None) is not None:
            emit(DropSavedKV(seq_id))

    def _map(self, saved: SwappedKV, slot: Slot) -> None:
        if saved.dropped:   # pages below the window stay unmapped
            with self.pages.table.accounting(slot):
                self.pages.open_window(slot, saved.dropped)
        self.pages.extend(slot, self.geo.pages_for(saved.tokens))

    def _start(self, saved: SwappedKV) -> int:
        """The first token saved: none below the window's unmapped pages."""
        return min(saved.dropped * self.geo.tokens_per_page, saved.tokens)
