"""Slots: one row of every virtual tensor per sequence, and which sequence owns each.

A freed slot keeps its exclusive pages mapped (parked) so a later owner can reuse them without new maps; pages
that no live token needs (parked ones, and pages mapped ahead in live slots) are counted as reclaimable.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vmm.geometry import Geometry


@dataclass(slots=True)
class Slot:
    """One row of every virtual tensor. `groups[j]` is the page group mapped at page j (pages 0..len-1)."""
    index: int
    groups: list[int] = field(default_factory=list)
    seq_id: int | None = None     # owner; None = free (maybe stale: still holding the last owner's pages)
    held: int = 0                 # tokens the owner may write (the largest allocate target)
    freed_at: int = 0             # when it became free (oldest stale slots are reclaimed first)


class SlotTable:
    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        self.slots = [Slot(i) for i in range(geo.num_slots)]
        self.slot_of: dict[int, int] = {}   # seq_id -> slot index
        self.excess = 0                     # mapped groups no live token needs (reclaimable)
        self._clock = 0

    def of(self, seq_id: int) -> Slot | None:
        index = self.slot_of.get(seq_id)
        return None if index is None else self.slots[index]

    def has_free(self) -> bool:
        return len(self.slot_of) < self.geo.num_slots

    def claim(self, seq_id: int, tokens: int, fewest_pages: bool = False) -> Slot:
        """A free slot: the one whose stale pages best cover `tokens` (fewest pages for a fork child, whose
        pages are replaced by the parent's)."""
        need = self.geo.pages_for(tokens)
        free = [s for s in self.slots if s.seq_id is None]
        if fewest_pages:
            slot = min(free, key=lambda s: (len(s.groups), s.index))
        else:  # smallest covering slot, else the largest one (fewest new maps)
            slot = min(free, key=lambda s: (len(s.groups) < need, abs(len(s.groups) - need), s.index))
        with self.accounting(slot):
            slot.seq_id, slot.held = seq_id, 0
        self.slot_of[seq_id] = slot.index
        return slot

    def vacate(self, slot: Slot) -> None:
        """The owner leaves; the slot keeps whatever pages it still maps."""
        with self.accounting(slot):
            del self.slot_of[slot.seq_id]
            slot.seq_id, slot.held = None, 0
            self._clock += 1
            slot.freed_at = self._clock

    def hold(self, slot: Slot, tokens: int) -> None:
        with self.accounting(slot):
            slot.held = tokens

    def stale(self) -> list[Slot]:
        """Free slots that still map pages, oldest first."""
        return sorted((s for s in self.slots if s.seq_id is None and s.groups), key=lambda s: s.freed_at)

    def live(self) -> list[Slot]:
        return [s for s in self.slots if s.seq_id is not None]

    def excess_of(self, slot: Slot) -> int:
        if slot.seq_id is None:
            return len(slot.groups)
        return max(0, len(slot.groups) - self.geo.pages_for(slot.held))

    @contextmanager
    def accounting(self, slot: Slot) -> Iterator[None]:
        """Keep the reclaimable-unit total in step with every change to a slot (never nest for one slot)."""
        before = self.excess_of(slot)
        try:
            yield
        finally:
            self.excess += self.excess_of(slot) - before

    def check(self, is_shared: Callable[[int], bool]) -> None:
        assert self.excess == sum(self.excess_of(s) for s in self.slots), "reclaimable count drifted"
        assert {s.seq_id: s.index for s in self.slots if s.seq_id is not None} == self.slot_of, \
            "slot owners and the sequence->slot table disagree"
        for s in self.slots:
            need = self.geo.pages_for(s.held) if s.seq_id is not None else 0
            assert len(s.groups) >= need, f"slot {s.index}: {s.held} live tokens but only {len(s.groups)} pages"
            for j, g in enumerate(s.groups):
                if is_shared(g):   # shared pages belong to live owners that need them
                    assert j < need, f"slot {s.index} page {j}: shared group {g} outside the live range"
