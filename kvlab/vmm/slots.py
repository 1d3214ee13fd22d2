"""Slots: one row of every virtual tensor per sequence, and which sequence owns each; where the 2L virtual tensors
(K_0..K_{L-1}, then V_0..V_{L-1}) live (`Ranges`).

Tensor t lives at `places[t] = (region, offset)`: its own reserved range, or one slice of a single range shared by
all (`single_range`). Slot s, page j of tensor t is the page at offset + s * row_bytes + j * page_size.

A freed slot keeps its exclusive pages mapped (parked) so a later owner can reuse them without new maps; pages
that no live token needs (parked ones, and pages mapped ahead in live slots) are counted as reclaimable.
Every change to a slot goes through `hold` or `accounting`, which keep running totals and indexes (reclaimable
pages, live tokens, stale slots oldest first, free slots by parked pages) so that no call scans all slots.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvlab.common.errors import RequestError

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.drivers.types import DriverStats, Mirror, Region
    from kvlab.vmm.geometry import Geometry

DROPPED = -1   # a page the sliding window left behind: unmapped, its group back in the pool (slot.groups[:dropped])


@dataclass(slots=True)
class Slot:
    """One row of every virtual tensor. `groups[j]` is the page group mapped at page j (pages 0..len-1); with a
    sliding window the first `dropped` entries are DROPPED (unmapped: no kernel reads below the window)."""
    index: int
    groups: list[int] = field(default_factory=list)
    seq_id: int | None = None     # owner; None = free (maybe stale: still holding the last owner's pages)
    held: int = 0                 # tokens the owner may write (the largest allocate target)
    freed_at: int = 0             # when it became free (oldest stale slots are reclaimed first)
    dropped: int = 0              # leading pages the window unmapped (only live slots have any)

    def live_groups(self) -> list[int]:
        """The groups the slot maps (without the window's DROPPED entries)."""
        return self.groups[self.dropped:]


class AddressSpace(Protocol):
    """What the ranges need of a driver (vmm/drivers/base.py's VirtualMemory)."""
    stats: DriverStats

    def reserve(self, nbytes: int) -> Region: ...

    def mirror(self, places: list[tuple[Region, int]], span: int, store_stride: int) -> Mirror: ...


@dataclass(slots=True)
class Ranges:
    """Where the 2L tensors live, and the mirror that maps a page group in all of them with one call."""
    places: list[tuple[Region, int]]
    mirror: Mirror

    @classmethod
    def reserve(cls, driver: AddressSpace, geo: Geometry, single_range: bool) -> Ranges:
        if single_range:
            whole = driver.reserve(geo.num_tensors * geo.tensor_bytes)
            places = [(whole, t * geo.tensor_bytes) for t in range(geo.num_tensors)]
        else:
            places = [(driver.reserve(geo.tensor_bytes), 0) for _ in range(geo.num_tensors)]
        return cls(places, driver.mirror(places, geo.tensor_bytes, geo.num_groups))

    def check_mapped(self, driver: AddressSpace, geo: Geometry, slots: list[Slot],
                     put_off: dict[int, list[tuple[int, int, int]]]) -> None:
        """Every page the slots claim is mapped by the driver at the right store page, and no other but those whose
        unmap a growth put off (`put_off`: slot -> (slot, first page, pages))."""
        total = 0
        for spots in put_off.values():
            for slot, first, count in spots:
                for region, offset in self.places:
                    va = (offset + slot * geo.row_bytes + first * geo.page_size) // geo.page_size
                    assert all(v in region.mapped for v in range(va, va + count)), \
                        f"slot {slot} pages {first}..{first + count - 1}: an unmap put off finds nothing mapped"
                total += count * geo.num_tensors
        for slot in slots:
            for j, g in enumerate(slot.groups[slot.dropped:], slot.dropped):
                for t, (region, offset) in enumerate(self.places):
                    va = (offset + slot.index * geo.row_bytes + j * geo.page_size) // geo.page_size
                    assert region.mapped.get(va) == t * geo.num_groups + g, \
                        f"slot {slot.index} page {j} tensor {t} is not mapped to group {g}"
            total += (len(slot.groups) - slot.dropped) * geo.num_tensors
        assert driver.stats.mapped_pages == total, "the driver maps pages no slot accounts for"


class FreeSlots:
    """Free slots bucketed by how many pages they still map: best-fit choice without a scan."""

    def __init__(self, num_slots: int) -> None:
        self.by_pages: dict[int, list[int]] = {0: list(range(num_slots))} if num_slots else {}   # sorted indices
        self.sizes: list[int] = sorted(self.by_pages)                                            # sorted keys

    def add(self, index: int, pages: int) -> None:
        bucket = self.by_pages.get(pages)
        if bucket is None:
            self.by_pages[pages] = [index]
            insort(self.sizes, pages)
        else:
            insort(bucket, index)

    def remove(self, index: int, pages: int) -> None:
        bucket = self.by_pages[pages]
        del bucket[bisect_left(bucket, index)]
        if not bucket:
            del self.by_pages[pages]
            del self.sizes[bisect_left(self.sizes, pages)]

    def covering(self, need: int) -> int:
        """The slot with the fewest pages >= need, else the one with the most; lowest index on ties."""
        i = bisect_left(self.sizes, need)
        return self.by_pages[self.sizes[i] if i < len(self.sizes) else self.sizes[-1]][0]

    def fewest(self) -> int:
        return self.by_pages[self.sizes[0]][0]

    def items(self) -> Iterator[tuple[int, int]]:
        """(index, pages) of every free slot."""
        return ((i, pages) for pages, bucket in self.by_pages.items() for i in bucket)


class SlotTable:
    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        self.slots = [Slot(i) for i in range(geo.num_slots)]
        self.slot_of: dict[int, int] = {}   # seq_id -> slot index
        self.excess = 0                     # mapped groups no live token needs (reclaimable)
        self.live_tokens = 0                # tokens the owners hold, all slots together
        self.stale: dict[int, None] = {}    # free slots still mapping pages, oldest freed first
        self.ahead: set[int] = set()        # live slots mapping pages beyond their held tokens
        self.free = FreeSlots(geo.num_slots)
        self._clock = 0

    def of(self, seq_id: int) -> Slot | None:
        index = self.slot_of.get(seq_id)
        return None if index is None else self.slots[index]

    def owned(self, seq_id: int, refusal: str) -> Slot:
        """The sequence's slot, for a call that needs one (`refusal` names it): RequestError if it holds none."""
        slot = self.of(seq_id)
        if slot is None:
            raise RequestError(f"{refusal} {seq_id}: it holds no vmm slot")
        return slot

    def unowned(self, seq_id: int, refusal: str) -> None:
        """For a call that gives the sequence a slot: RequestError if it already holds one."""
        if seq_id in self.slot_of:
            raise RequestError(f"{refusal} {seq_id}: it already holds a slot")

    def covering(self, seq_id: int, context_len: int) -> Slot:
        """The slot a kernel reads the sequence's first `context_len` positions from: RequestError if they are
        not allocated."""
        slot = self.of(seq_id)
        if slot is None:
            raise RequestError(f"sequence {seq_id} holds no vmm slot; allocate it before prepare")
        mapped = min(len(slot.groups) * self.geo.tokens_per_page, slot.held)
        if context_len > mapped:
            raise RequestError(f"sequence {seq_id}: positions up to {context_len} are not allocated ({mapped} are); "
                               f"call allocate(seq, {context_len}) before prepare")
        return slot

    def has_free(self) -> bool:
        return len(self.slot_of) < self.geo.num_slots

    def claim(self, seq_id: int, tokens: int, fewest_pages: bool = False) -> Slot:
        """A free slot: the one whose stale pages best cover `tokens` (fewest pages for a fork child, whose
        pages are replaced by the parent's)."""
        index = self.free.fewest() if fewest_pages else self.free.covering(self.geo.pages_for(tokens))
        slot = self.slots[index]
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

    def hold_each(self, seqs: list[Sequence], targets: list[int], i: int, busy: Container[int] = (),
                  ahead: int = 0, near: list[tuple[Slot, int]] | None = None) -> int:
        """`hold` for seqs[i:] in turn while each target stays within the last page its slot holds (the per-step
        decode path: only the live count moves); returns the index of the first that needs more (no slot, a slot
        in `busy`, or a page past its held ones). `ahead` > 0 (background mapping): each slot held whose next
        unmapped page starts within `ahead` tokens of its target goes into `near` with that target."""
        slot_of, slots, tpp = self.slot_of, self.slots, self.geo.tokens_per_page
        live = 0
        for j in range(i, len(seqs)):
            index = slot_of.get(seqs[j].seq_id)
            if index is None or index in busy:
                break
            slot = slots[index]
            held, tokens = slot.held, targets[j]
            if tokens > held:
                if not held or (held - 1) // tpp != (tokens - 1) // tpp:
                    break
                live += tokens - held
                slot.held = tokens
            if ahead and (tokens + ahead - 1) // tpp >= len(slot.groups):
                near.append((slot, tokens))
        else:
            j = len(seqs)
        self.live_tokens += live
        return j

    def hold(self, slot: Slot, tokens: int) -> None:
        """A live slot's owner may now write `tokens` tokens (the per-step path: no context manager)."""
        if slot.seq_id is None:
            with self.accounting(slot):
                slot.held = tokens
            return
        tpp, held = self.geo.tokens_per_page, slot.held
        if held and (held - 1) // tpp == (tokens - 1) // tpp:   # the same last page: only the live count moves
            self.live_tokens += tokens - held
            slot.held = tokens
            return
        pages = len(slot.groups)
        before = max(0, pages + (slot.held // -tpp))
        after = max(0, pages + (tokens // -tpp))
        self.excess += after - before
        self.live_tokens += tokens - slot.held
        slot.held = tokens
        if after:
            self.ahead.add(slot.index)
        elif before:
            self.ahead.discard(slot.index)

    def sort_stale(self) -> None:
        """Stale slots oldest freed first again (a slot whose reclaim was undone became stale anew)."""
        self.stale = dict.fromkeys(sorted(self.stale, key=lambda i: self.slots[i].freed_at))

    def live(self) -> list[Slot]:
        return [self.slots[i] for i in sorted(self.slot_of.values())]

    def excess_of(self, slot: Slot) -> int:
        if slot.seq_id is None:
            return len(slot.groups)
        return max(0, len(slot.groups) - self.geo.pages_for(slot.held))

    @contextmanager
    def accounting(self, slot: Slot) -> Iterator[None]:
        """Keep the totals and indexes in step with any change to a slot (never nest for one slot)."""
        was_free, pages, excess, held = slot.seq_id is None, len(slot.groups), self.excess_of(slot), slot.held
        try:
            yield
        finally:
            self._settle(slot, was_free, pages, excess, held)

    def _settle(self, slot: Slot, was_free: bool, pages: int, excess: int, held: int) -> None:
        is_free, now, i = slot.seq_id is None, len(slot.groups), slot.index
        after = self.excess_of(slot)
        self.excess += after - excess
        self.live_tokens += (0 if is_free else slot.held) - (0 if was_free else held)
        if was_free != is_free or pages != now:
            if was_free:
                self.free.remove(i, pages)
            if is_free:
                self.free.add(i, now)
        if (was_free and pages) and not (is_free and now):
            del self.stale[i]
        elif (is_free and now) and not (was_free and pages):
            self.stale[i] = None   # newly stale: it was just freed, so it is the youngest
        if after and not is_free:
            self.ahead.add(i)
        else:
            self.ahead.discard(i)

    def check(self, is_shared: Callable[[int], bool]) -> None:
        assert self.excess == sum(self.excess_of(s) for s in self.slots), "reclaimable count drifted"
        assert {s.seq_id: s.index for s in self.slots if s.seq_id is not None} == self.slot_of, \
            "slot owners and the sequence->slot table disagree"
        for s in self.slots:
            need = self.geo.pages_for(s.held) if s.seq_id is not None else 0
            assert len(s.groups) >= need, f"slot {s.index}: {s.held} live tokens but only {len(s.groups)} pages"
            assert s.groups[:s.dropped] == [DROPPED] * s.dropped and DROPPED not in s.groups[s.dropped:], \
                f"slot {s.index}: window-dropped entries {s.groups[:s.dropped]} are not exactly its leading pages"
            assert not (s.dropped and s.seq_id is None), f"free slot {s.index} keeps window holes"
            for j, g in enumerate(s.groups[s.dropped:], s.dropped):
                if is_shared(g):   # shared pages belong to live owners that need them
                    assert j < need, f"slot {s.index} page {j}: shared group {g} outside the live range"
        assert self.live_tokens == sum(s.held for s in self.slots if s.seq_id is not None), "live tokens drifted"
        stale = sorted((s for s in self.slots if s.seq_id is None and s.groups), key=lambda s: s.freed_at)
        assert list(self.stale) == [s.index for s in stale], "stale slots are out of order"
        assert sorted(self.free.items()) == [(s.index, len(s.groups)) for s in self.slots if s.seq_id is None], \
            "free-slot index drifted"
        assert all(b == sorted(b) and b for b in self.free.by_pages.values()), "free-slot buckets unsorted"
        assert self.free.sizes == sorted(self.free.by_pages), "free-slot sizes drifted"
        assert self.ahead == {s.index for s in self.slots if s.seq_id is not None and self.excess_of(s)}, \
            "mapped-ahead slot set drifted"
