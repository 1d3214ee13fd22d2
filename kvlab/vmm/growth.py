"""Growing a sequence's slot to hold a token count (`SlotGrowth`): what that costs in page groups, and getting
them (a slot claimed with its prefix hits aliased in, shared pages copied before a write, pages below a sliding
window unmapped, new pages mapped, retried once after unmapping parked pages when the OS mappings run out). With
prefix caching, which pages of the live sequences to register in the cache (vmm/prefix.py) and a new sequence's
slot with its cached leading pages aliased in, mapped again at the same page indices: the fork path, copy-on-write
if written (`PrefixAliases`). With background mapping, a worker thread maps the pages a slot will need soon, off
the critical path (`BackgroundMapper`): it changes the cache's tables only under the cache's lock; before the cache
touches a slot it fences that slot (waits for its job), and a worker error is re-raised there, in the caller.
The same worker also runs the unmaps a growth on the step put off: a growth that reclaims a parked page (or one
mapped ahead) maps it at its new place at once and leaves the old place mapped, listed by no slot, until the next
job unmaps it during the forward pass (vmm/page_calls.py); a row whose unmaps are put off runs them before anything
maps there again.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from kvlab.vmm.drivers.map_budget import MapBudgetExhausted

if TYPE_CHECKING:
    from kvlab.common.kv.types import MoveSink
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.drivers.machine_pool import MachinePool
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.pages import SlotPages
    from kvlab.vmm.prefix import PagePrefixCache
    from kvlab.vmm.slots import Slot, SlotTable
    from kvlab.vmm.swap import SwapSpace

LOOKAHEAD_FRACTION = 8   # background mapping starts when a sequence is within 1/8 page of its next page

MapAhead = Callable[[int, int, int], bool]   # (slot index, owner seq_id, target pages) -> mapped anything


class BackgroundMapper:
    """Maps pages ahead of the slots that will need them soon, on a worker thread while the model runs. A step's
    requests are collected while it is scheduled and launched together when the step's rows are read (`launch`,
    right before the forward pass), so the worker never competes for the lock with the scheduler's allocate calls;
    a slot's job is fenced (waited for) before its next allocate."""

    def __init__(self, geo: Geometry, lock: threading.RLock, map_ahead: MapAhead, enabled: bool,
                 os_calls: Callable[[], int]) -> None:
        self.geo = geo
        self.lock = lock
        self.ahead = max(1, geo.tokens_per_page // LOOKAHEAD_FRACTION)   # tokens before a page that ask for it
        self.seconds = 0.0                      # worker time spent mapping
        self.calls = 0                          # the driver's OS calls the worker's jobs made (os_calls: the total)
        self.pending: dict[int, Future] = {}    # slot index -> its launched job (one job maps a whole step's)
        self.wanted: dict[int, tuple[int, int]] = {}   # slot index -> (owner, target pages): not launched yet
        self.unmapping: Future | None = None    # the last job that runs unmaps growths put off
        self._map_ahead, self._os_calls = map_ahead, os_calls
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvlab-vmm-mapper") if enabled else None
        self.enabled = enabled

    def request(self, slot: Slot, tokens: int) -> None:
        """Map ahead of a slot that now holds `tokens` tokens, if it is near its next page (at the next launch)."""
        target = min(self.geo.pages_for(tokens + self.ahead), self.geo.pages_per_slot)
        if target > len(slot.groups) and slot.index not in self.pending:
            self.wanted[slot.index] = (slot.seq_id, target)

    def launch(self, unmaps: Callable[[], None] | None = None) -> None:
        """Start the wanted jobs as one on the worker (the step's books are settled; the forward pass is next),
        after `unmaps`: the unmaps the step's growths put off."""
        if not self.wanted and unmaps is None:
            return
        jobs, self.wanted = list(self.wanted.items()), {}
        future = self._executor.submit(self._run, jobs, unmaps)
        for index, _ in jobs:
            self.pending[index] = future
        if unmaps is not None:
            self.unmapping = future

    def _run(self, jobs: list[tuple[int, tuple[int, int]]], unmaps: Callable[[], None] | None) -> None:
        with self.lock:
            t0, calls = time.perf_counter(), self._os_calls()
            try:
                if unmaps is not None:
                    unmaps()
                mapped = [self._map_ahead(index, seq_id, target) for index, (seq_id, target) in jobs]
            finally:
                self.calls += self._os_calls() - calls
            if unmaps is not None or any(mapped):
                self.seconds += time.perf_counter() - t0

    def busy(self) -> set[int]:
        """The slots with a job wanted or launched: a change to one fences it first."""
        return self.pending.keys() | self.wanted.keys()

    def cancel(self, index: int | None) -> None:
        """Forget a slot's job that has not started (its slot is being given up)."""
        self.wanted.pop(index, None)

    def fence_one(self, index: int | None) -> None:
        """Before a slot changes: launch and wait for its job; re-raise a background error here, in the caller.
        Call without the lock (the job takes it)."""
        if index in self.wanted:
            self.launch()
        future = self.pending.pop(index, None)
        if future is not None:
            future.result()

    def fence_slot(self, index: int | None, drop: bool = False) -> None:
        """Wait for a slot's job before the cache changes the slot (`drop`: the slot is given up, so a job not
        launched yet is forgotten instead)."""
        if drop:
            self.cancel(index)
        self.fence([index])

    def fence(self, indices: list[int | None]) -> None:
        """Wait for these slots' jobs, then re-raise any finished job's error here, in the caller."""
        for index in indices:
            self.fence_one(index)
        for index, future in list(self.pending.items()):
            if future.done():
                del self.pending[index]
                future.result()
        if self.unmapping is not None and self.unmapping.done():
            future, self.unmapping = self.unmapping, None
            future.result()

    def in_flight(self) -> list[int]:
        """The slots whose map-ahead job is wanted or running."""
        running = {i for i, future in self.pending.items() if not future.done()}
        return sorted(running | self.wanted.keys())

    def close(self) -> BaseException | None:
        """Stop the worker; returns the first error a job left behind (the caller raises it)."""
        error = None
        self.wanted.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            for future in [*self.pending.values(), *([self.unmapping] if self.unmapping is not None else [])]:
                error = error or future.exception()
            self.pending.clear()
            self.unmapping = None
        return error


class SlotGrowth:
    """`window`: the model's sliding window (None: full attention, no page is ever unmapped below it)."""

    def __init__(self, pages: SlotPages, prefix: PrefixAliases | None, swap: SwapSpace, window: int | None,
                 pool: MachinePool) -> None:
        self.pages, self.prefix, self.swap, self.window, self.pool = pages, prefix, swap, window, pool
        self.geo, self.table, self.free_pages = pages.geo, pages.table, pages.free_pages
        self.tokens_per_page = self.geo.tokens_per_page

    # -- cost -----------------------------------------------------------------------------------------------
    def free_units(self) -> int:
        """Free groups, reclaimable mapped ones and idle cached ones: all can be taken."""
        return self.free_pages.num_free + self.table.excess + self._idle_units()

    def available_units(self) -> int:
        """What can be taken now: free units, the unmapped ones only as far as a machine-wide pool can back them
        (other engines hold the rest). Read from the books, with no call into the pages room (the walk)."""
        unmapped = self.free_pages.num_free
        if self.pool.elastic:
            unmapped = min(unmapped, self.pool.room_pages() // self.geo.num_tensors)
        return self.table.excess + self._idle_units() + unmapped

    def _idle_units(self) -> int:
        """Cached groups no slot maps (prefix caching): free once evicted."""
        return 0 if self.prefix is None else len(self.prefix.cache.idle)

    def fits(self, seq: Sequence, num_tokens: int, reserve_units: int) -> bool:
        """Whether growing to `num_tokens` leaves `reserve_units` free (asked for every running sequence every
        step: no scans)."""
        if num_tokens > self.geo.max_len:
            return False
        index = self.table.slot_of.get(seq.seq_id)
        if index is None:
            if len(self.table.slot_of) >= self.geo.num_slots:   # no free slot
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
        if slot is None or self.free_pages.num_shared or -(-num_tokens // self.tokens_per_page) > len(slot.groups):
            return False
        if num_tokens > slot.held:
            self.table.hold(slot, num_tokens)
        return True

    def grow(self, seq: Sequence, num_tokens: int, emit: MoveSink) -> int | None:
        """Make the sequence hold `num_tokens`; returns the prefix-hit tokens, or None when out of OS mappings. Its OS
        calls count as an admission's (no slot yet) or a growth's."""
        index = self.table.slot_of.get(seq.seq_id)
        slot = None if index is None else self.table.slots[index]
        stats, counters = self.pages.driver.stats, self.pages.counters   # read inline: no call back up the walk
        calls = stats.map_calls + stats.unmap_calls
        try:
            return self._grow_slot(seq, slot, num_tokens, emit)
        finally:
            made = stats.map_calls + stats.unmap_calls - calls
            if slot is None:
                counters.admission_calls += made
            else:
                counters.growth_calls += made

    def _grow_slot(self, seq: Sequence, slot: Slot | None, num_tokens: int, emit: MoveSink) -> int | None:
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
        """Unmap the parked pages of freed slots (kept for reuse) and the unmaps put off: their mappings and memory
        go back."""
        self.pages.calls.flush_all()
        for index in list(self.table.stale):
            self.pages.drop_all(self.table.slots[index])

    def _grow(self, seq: Sequence, slot: Slot | None, num_tokens: int, emit: MoveSink) -> int:
        """Decided here, done by the pages room in one call (claiming a slot first for a first allocation)."""
        claimed, hit = slot is None, 0
        if claimed and self.prefix is not None:   # its cached prefix pages aliased in
            slot, hit = self.prefix.claim(seq, num_tokens)
        elif claimed:
            slot = self.table.claim(seq.seq_id, num_tokens)
        try:
            self.pages.grow(slot, max(seq.num_computed_tokens, hit), num_tokens, emit)   # hits: not written
        except BaseException:
            if claimed:   # a failed first allocation leaves the sequence holding nothing
                if self.prefix is not None:
                    self.prefix.forget(seq.seq_id)
                self.pages.release(slot)
            raise
        return hit

    def retire(self, seq: Sequence, slot: Slot) -> None:
        """The sequence gives its slot up (freed, swapped out): its computed pages stay findable (prefix caching)."""
        if self.prefix is not None:
            self.prefix.register(seq, slot)
            self.prefix.forget(seq.seq_id)
        self.pages.release(slot)

    def map_ahead(self, index: int, seq_id: int, target: int) -> bool:
        """The background mapper's job: mapping ahead is skipped, not failed, when the OS mappings are spent."""
        try:
            return self.pages.map_ahead(index, seq_id, target)
        except MapBudgetExhausted:
            self.pages.counters.lookahead_skipped += 1
            return False


class PrefixAliases:
    """The cache, the live sequences whose computed pages it registers, and the tokens its hits saved."""

    def __init__(self, cache: PagePrefixCache, table: SlotTable, pages: SlotPages) -> None:
        self.cache, self.table, self.pages = cache, table, pages
        self.owners: dict[int, Sequence] = {}   # the live sequences, to register their pages
        self.hit_tokens = 0

    def units_to_admit(self, seq: Sequence, num_tokens: int, need: int) -> int:
        """`need` pages less the hits mapped in another slot (free); idle hits still cost a unit each."""
        hits = self.match(seq, num_tokens)
        return need - len(hits) + self.cache.idle_hits(hits)

    def match(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Cached leading pages of a new sequence, after registering what live sequences computed since their
        last allocate (as paged does: a prompt admitted next to its twin still hits)."""
        for owner in self.owners.values():
            slot = self.table.of(owner.seq_id)
            if slot is not None:
                self.register(owner, slot)
        return self.cache.match(seq, num_tokens)

    def register(self, seq: Sequence, slot: Slot) -> None:
        """Make the sequence's computed full pages findable by later prompts."""
        self.cache.register(seq, slot.groups, min(seq.num_computed_tokens, slot.held, seq.num_tokens))

    def claim(self, seq: Sequence, num_tokens: int) -> tuple[Slot, int]:
        """A slot for a first allocation, with its cached prefix pages aliased in; returns it and the hit tokens."""
        hits = self.match(seq, num_tokens)
        self.owners[seq.seq_id] = seq
        if not hits:
            return self.table.claim(seq.seq_id, num_tokens), 0
        tokens = len(hits) * self.cache.tokens_per_page
        alias = partial(self.pages.alias, groups=[g for g, _ in hits], tokens=tokens)
        try:
            slot = self.pages.new_slot(seq.seq_id, num_tokens, alias, fewest_pages=True)
        except BaseException:
            self.forget(seq.seq_id)
            raise
        self.cache.adopt(seq.seq_id, [h for _, h in hits])
        self.hit_tokens += tokens
        return slot, tokens

    def track(self, seq: Sequence) -> None:
        """A sequence holds a slot again (swapped in): register its pages from now on."""
        self.owners[seq.seq_id] = seq

    def fork(self, parent: Sequence, source: Slot, child: Sequence) -> None:
        """The child maps the parent's pages: it starts with the parent's registered chain."""
        self.register(parent, source)
        self.cache.adopt(child.seq_id, self.cache.chains.get(parent.seq_id, []))
        self.owners[child.seq_id] = child

    def forget(self, seq_id: int) -> None:
        """The sequence no longer maps its pages (freed, swapped out)."""
        self.cache.forget(seq_id)
        self.owners.pop(seq_id, None)

    def stats(self) -> dict[str, Any]:
        cache = self.cache
        return {"prefix_caching": "on", "prefix_cached_pages": len(cache), "prefix_idle_pages": len(cache.idle),
                "prefix_evictions": cache.evictions, "prefix_hash_collisions": cache.collisions}
