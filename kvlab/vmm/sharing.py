"""What the allocator does for other engines on the same machine-wide pool (docs/pool.md), under its lock: give
pages back when they ask (`GiveBack`, called from the pool's steward thread), and its handoff API (`PageExports`,
`allocator.exports`): a sequence's pages leave for another engine, or pages that came from one fill a new slot
(vmm/handoff.py drives it; docs/disaggregation.md)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from kvlab.common.handoff.seam import HandoffError, HandoffRefused

if TYPE_CHECKING:
    from kvlab.vmm.drivers.machine_pool import MachinePool
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.pages import SlotPages
    from kvlab.vmm.slots import Slot


class GiveBack:
    """The engine's answer when other engines on the pool want pages. `closed`: the allocator closed (answer
    nothing)."""

    def __init__(self, lock: threading.RLock, pages: SlotPages, pool: MachinePool,
                 drop_stale: Callable[[], None]) -> None:
        """`drop_stale`: unmap the parked pages of freed slots (the allocator's growth does it)."""
        self.lock, self.free_pages, self.pool, self.drop_stale = lock, pages.free_pages, pool, drop_stale
        self.table, self.tensors, self.counters = pages.table, pages.geo.num_tensors, pages.counters
        self.closed = False

    def givable_pages(self) -> int:
        """Pages a give-back could return now: spares, freed slots' parked pages, idle cached groups' pages
        (published to the pool each steward round, so askers wait only when something can come)."""
        with self.lock:
            if self.closed:
                return 0
            parked = sum(len(self.table.slots[i].groups) for i in self.table.stale)
            return self.pool.spare_pages() + (parked + self.free_pages.num_idle()) * self.tensors

    def __call__(self, wanted: int) -> None:
        """Give spare pages back, unmapping freed slots' parked pages first if the spares fall short; then evict
        idle prefix-cache groups (whole groups, least recent first) and give theirs; never below the engine's floor.
        An engine running nothing gives every spare and parked page at once, not only what is wanted: the asker's
        next takes then find them free instead of waiting a steward round each (kvcached #359: an idle engine pins
        nothing)."""
        with self.lock:
            if self.closed:
                return
            running_nothing = not self.table.slot_of
            if self.table.stale and (running_nothing or self.pool.spare_pages() < wanted):
                self.drop_stale()
            given = self.pool.give_spare(self.pool.spare_pages() if running_nothing else wanted)
            tensors = self.tensors
            groups = min(-(-(wanted - given) // tensors), self.pool.above_floor() // tensors)
            evicted = self.free_pages.evict(groups) if groups > 0 else 0
            if evicted:
                self.counters.evicted_for_pool += evicted
                self.pool.give_spare(wanted - given)


class PageExports:
    """The handoff API. Pages are named tensor by tensor, the order they travel in: local page g + t * stride of
    each tensor t for each of the sequence's page groups g."""
    def __init__(self, lock: threading.RLock, geo: Geometry, pages: SlotPages, pool: MachinePool,
                 stride: int) -> None:
        self.lock, self.geo, self.pages, self.pool, self.stride = lock, geo, pages, pool, stride
        self.table = pages.table

    def local_pages(self, groups: list[int]) -> list[int]:
        """The local pages of these groups in every tensor, tensor by tensor."""
        return [g + i * self.stride for i in range(self.geo.num_tensors) for g in groups]

    def export(self, seq_id: int, num_tokens: int) -> tuple[list[int], list[int]]:
        """The local pages holding the sequence's first `num_tokens` tokens and the pool pages behind them."""
        with self.lock:
            slot = self.table.owned(seq_id, "cannot hand off sequence")
            if slot.dropped:
                raise HandoffError("a sliding window unmapped this sequence's first pages: it cannot be handed off")
            local = self.local_pages(slot.groups[:self.geo.pages_for(num_tokens)])
            handoff = self.pool.handoff_pages()
            return local, [handoff.pool_page(p) for p in local]

    def let_go(self, seq_id: int, local: list[int]) -> None:
        """Another engine took the exported pages: unmap the sequence's pages and forget the pool pages behind the
        exported ones (they are not this engine's to give); the sequence is freed next, as usual."""
        with self.lock:
            slot = self.table.owned(seq_id, "cannot let go of the pages of sequence")
            self.pages.drop_all(slot)
            self.pool.handoff_pages().disown(local)

    def receive(self, seq_id: int, num_tokens: int, pool_pages: list[int], transfer: Callable[[], None]) -> None:
        """A new slot for the sequence, mapped over `pool_pages` (another engine's, moved to this one by
        `transfer`, all or nothing, before any page is mapped). HandoffRefused when no slot is free; after a failed
        fill the received pages no local page adopted go back to the pool."""
        handoff, groups = self.pool.handoff_pages(), self.geo.pages_for(num_tokens)
        with self.lock:
            if not self.table.has_free():
                raise HandoffRefused("no free vmm slot for the imported KV")
            handoff.make_room(len(pool_pages))
            transfer()
            fill = partial(self._fill, groups, pool_pages, num_tokens)
            try:
                self.pages.new_slot(seq_id, num_tokens, fill, fewest_pages=True)
            except BaseException:
                handoff.give_unadopted(pool_pages)
                raise

    def _fill(self, count: int, pool_pages: list[int], num_tokens: int, slot: Slot) -> None:
        """The slot's first pages hold the prompt's K/V as the other engine wrote them."""
        adopt = self.pool.handoff_pages().adopt
        self.pages.fill_with(slot, count, num_tokens, lambda groups: adopt(dict(zip(self.local_pages(groups),
                                                                                        pool_pages))))
