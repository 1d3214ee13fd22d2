"""The vmm allocator (the scheduler's side): per layer, K and V are contiguous virtual tensors [max_seqs, max_len, H_kv,
D]; physical pages are mapped into a sequence's row (its slot) as it grows, so unmodified contiguous kernels run on
them (vmm/storage.py).

The backend is three rooms; a call walks down them once, never back to a room it left (docs/architecture.md):
- the allocator (this module, vmm/growth.py, vmm/swap.py, vmm/sharing.py): the books of which sequence holds which
  pages, what a growth costs and its one fast path (`SlotGrowth.in_place`), prefix aliases, swap, the background
  mapper, and what the engine does for other engines on a machine-wide pool (give back, hand off); it decides
  from the books and hands a growth to the pages in one call;
- the pages (vmm/pages.py, vmm/reclaim.py, vmm/free_pages.py, vmm/slots.py, vmm/prefix.py): page groups moved
  between the free list and slot rows, each move booked first and its driver calls handed down as one batch;
- the memory (vmm/drivers/): a `VirtualMemory` driver (host, cuda, accounting, pooled) and its `MachinePool`.
vmm/geometry.py, the layout's constants and arithmetic, is read by all three.

A unit is a page group: one page in each of the 2L tensors (vmm/geometry.py). This class is the front: the seam's
calls under one lock. It is bookkeeping only: the K/V bytes it decides to move (a page copied for copy-on-write, a
sequence saved or restored for swap) are orders it emits (common/kv/types.py), carried out by the storage. Unlike
vAttention (which drops some errors silently and runs an unlocked background thread) every error raises, a lock
guards all page-table state, the background mapper is fenced and its errors reach the caller, pages can be shared
between forks (copy-on-write) and swapped out. With the accounting driver and no storage (the simulator) the same
code runs with no memory.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import ConfigError, OutOfKVCache, RequestError
from kvlab.common.kv.seam import Allocator, timed, timed_allocate
from kvlab.common.kv.types import CacheStats, KVShape
from kvlab.vmm.free_pages import FreePages, PageCounters
from kvlab.vmm.geometry import make_geometry
from kvlab.vmm.growth import BackgroundMapper, PrefixAliases, SlotGrowth
from kvlab.vmm.pages import SlotPages
from kvlab.vmm.prefix import KeptGroups, PagePrefixCache
from kvlab.vmm.sharing import GiveBack, PageExports
from kvlab.vmm.slots import Ranges, SlotTable
from kvlab.vmm.swap import SwapSpace

if TYPE_CHECKING:
    from kvlab.common.attention.metadata import BatchItem
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.slots import Slot

log = logging.getLogger("kvlab.vmm")
# The page counters stats() reports in `extra` (the rest have CacheStats fields of their own); read by name, not
# through dataclasses.asdict, which deep-copies: stats() runs every engine step.
COUNTER_EXTRAS = tuple(f.name for f in dataclasses.fields(PageCounters) if f.name not in CacheStats.__slots__)


class VMMAllocator(Allocator):
    """Slots, pages and the driver behind them; the seam's calls, and the step-side read the storage uses (rows)."""

    name = "vmm"
    unit_name = "page"

    def __init__(self, config: EngineConfig, shape: KVShape, driver: VirtualMemory,
                 single_range: bool | None = None) -> None:
        opts = config.options_of("vmm")
        self.config, self.shape, self.driver = config, shape, driver
        self.pool = pool = driver.pool   # the machine-wide pool the driver's pages come from (NO_POOL: none)
        window = shape.sliding_window
        if window is not None and config.enable_prefix_caching:
            raise ConfigError("vmm: prefix caching with a sliding-window model is not supported (the window unmaps "
                              "the leading pages a prefix hit would share); disable one of them")
        self._lock = threading.RLock()
        try:
            geo = self.geo = make_geometry(config, shape, driver.page_size)
            self.ranges = Ranges.reserve(driver, geo, opts.vmm_single_range if single_range is None else single_range)
            driver.create_store(geo.num_tensors * geo.num_groups)
        except BaseException:
            _close_quietly(driver)
            raise
        self.tokens_per_unit = geo.tokens_per_page
        keeper = KeptGroups(pool, geo.num_groups, geo.num_tensors)
        cache = PagePrefixCache(geo.tokens_per_page, keeper=keeper) if config.enable_prefix_caching else None
        self.free_pages, self.table = FreePages(geo.num_groups, cache), SlotTable(geo)
        self.pages = SlotPages(geo, driver, self.ranges.mirror, self.free_pages, self.table,
                               put_off=opts.background_mapping)   # the mapper runs the unmaps growths put off
        self.prefix = PrefixAliases(cache, self.table, self.pages) if cache is not None else None
        self.swap = SwapSpace(self.pages, shape.bytes_per_token)
        self.growth = SlotGrowth(self.pages, self.prefix, self.swap, window, pool)
        counts = driver.stats   # the mapper counts the OS calls its jobs make
        self.mapper = BackgroundMapper(geo, self._lock, self.growth.map_ahead, opts.background_mapping,
                                       lambda: counts.map_calls + counts.unmap_calls)
        self.closed = False
        self.plain = cache is None and window is None    # allocate's in-place path applies
        self.also_fits: Callable[[int], bool] = _any_units  # a further limit on the units a growth takes (what-ifs)
        self.give_back = GiveBack(self._lock, self.pages, pool, self.growth.drop_stale)
        pool.answer_asks(self.give_back, self.give_back.givable_pages)   # other engines on the pool may ask
        self.exports = PageExports(self._lock, geo, self.pages, pool, self.ranges.mirror.store_stride)

    # -- capacity -----------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.geo.num_groups

    def num_free_units(self) -> int:
        """On a pool: what the pool can give this engine now, not its whole ceiling."""
        with self._lock:   # the background mapper moves pages from the pool to a slot's tail
            return self.growth.available_units()

    def begin_step(self) -> None:
        self.pool.begin_step()

    def shortage_is_transient(self, seq: Sequence, num_tokens: int) -> bool:
        """On a pool other engines hold memory that comes back: a sequence within this engine's ceiling fits
        once they give it."""
        if not self.pool.elastic or num_tokens > self.geo.max_len:
            return False
        ceiling = min(self.geo.num_groups, self.pool.ceiling_pages() // self.geo.num_tensors)
        return self.geo.pages_for(num_tokens) <= ceiling

    def max_tokens_per_seq(self) -> int:
        return min(self.geo.num_groups * self.geo.tokens_per_page, self.geo.max_len)

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        with self._lock:
            slot = self.table.of(seq.seq_id)
            if slot is None:
                return self.growth.units_to_admit(seq, num_tokens)
            return self.growth.units_to_grow(slot, seq, num_tokens)

    def _fits(self, seq: Sequence, num_tokens: int, reserve_units: int) -> bool:
        with self._lock:
            if not self.growth.fits(seq, num_tokens, reserve_units):
                return False
        return self.also_fits is _any_units or self.also_fits(self.units_needed(seq, num_tokens) + reserve_units)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.table.slot_of

    @timed_allocate
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        index = self.table.slot_of.get(seq.seq_id)   # changed only by this thread's calls
        if self.plain and not reserve_units and index is not None:
            mapper = self.mapper
            if mapper.enabled:   # this slot's job (it mapped during the last forward pass) and its error; other
                mapper.fence_one(index)   # slots' jobs change slots only under the lock
            with self._lock:   # the per-step decode path (growth.in_place, the one fast path)
                slot = self.table.slots[index]
                if self.growth.in_place(slot, num_tokens):
                    if mapper.enabled:
                        mapper.request(slot, num_tokens)
                    return 0
        if not self._fits(seq, num_tokens, reserve_units):
            return None
        self.mapper.fence_slot(self.table.slot_of.get(seq.seq_id))
        with self._lock:
            if seq.seq_id in self.swap.swapped:
                raise RequestError(f"sequence {seq.seq_id} is swapped out; swap_in before allocate")
            hit = self.growth.grow(seq, num_tokens, self.emit)
            if hit is not None and self.mapper.enabled:
                self.mapper.request(self.table.of(seq.seq_id), num_tokens)
            return hit

    @timed
    def hold_in_place(self, seqs: list[Sequence], targets: list[int], i: int) -> int:
        """The step's decode tokens that stay in their slot's last held page, as one loop (SlotTable.hold_each).
        With background mapping the loop stops at a slot with a job (`allocate` fences it) and asks for pages
        ahead of the slots it held near their next page, as `allocate` does."""
        if not self.plain:
            return i
        mapper = self.mapper
        with self._lock:
            if self.free_pages.num_shared:
                return i
            if not mapper.enabled:
                return self.table.hold_each(seqs, targets, i)
            near: list[tuple[Slot, int]] = []
            done = self.table.hold_each(seqs, targets, i, mapper.busy(), mapper.ahead, near)
            for slot, tokens in near:
                mapper.request(slot, tokens)
            return done

    @timed
    def free(self, seq: Sequence) -> None:
        try:
            self.mapper.fence_slot(self.table.slot_of.get(seq.seq_id), drop=True)
        finally:   # a background error surfaces here, but the sequence is freed all the same
            with self._lock:
                self.swap.drop(seq.seq_id, self.emit)
                slot = self.table.of(seq.seq_id)
                if slot is not None:
                    self.growth.retire(seq, slot)

    @timed
    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.mapper.fence_slot(self.table.slot_of.get(parent.seq_id))
        with self._lock:
            source = self.table.owned(parent.seq_id, "cannot fork sequence")
            self.table.unowned(child.seq_id, "cannot fork into sequence")
            if not self.table.has_free():
                raise OutOfKVCache(f"no free vmm slot for fork child {child.seq_id} (max_num_seqs="
                                   f"{self.geo.num_slots})")
            self.pages.new_slot(child.seq_id, source.held, partial(self.pages.share, source), fewest_pages=True)
            if self.prefix is not None:
                self.prefix.fork(parent, source, child)

    @timed
    def swap_out(self, seq: Sequence) -> None:
        self.mapper.fence_slot(self.table.slot_of.get(seq.seq_id), drop=True)
        with self._lock:
            slot = self.table.owned(seq.seq_id, "cannot swap out sequence")
            self.swap.save(seq, slot, self.emit)   # the storage copies the K/V out before the pages go
            self.growth.retire(seq, slot)

    @timed
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        if not self._fits(seq, seq.num_computed_tokens, reserve_units):
            return False
        with self._lock:
            if seq.seq_id not in self.swap.swapped:
                raise RequestError(f"cannot swap in sequence {seq.seq_id}: it was not swapped out")
            self.table.unowned(seq.seq_id, "cannot swap in sequence")
            if not self.swap.restore(seq, self.emit):
                return False
            if self.prefix is not None:
                self.prefix.track(seq)
            return True

    # -- what the storage asks each step --------------------------------------------------------------------
    def rows(self, items: list[BatchItem], check: bool) -> tuple[list[int], list[int]]:
        """Each item's slot and readable length: up to the last page its held tokens need (pages past it, mapped
        ahead or parked, are reclaimable by any allocate, so they are not promised to a kernel). `check`: run
        check_invariants first. Raises RequestError if an item's context is not allocated. Jobs in flight are not
        waited for (only finished ones' errors raised): they map pages past the held tokens, which no row reads."""
        self.mapper.fence([])
        with self._lock:
            calls = self.pages.calls   # this step's map-ahead jobs and put-off unmaps run while the model does
            self.mapper.launch(calls.flush_all if calls.put_off else None)
            if check:
                self.check_invariants()
            slots = [self.table.covering(it.seq.seq_id, it.context_len) for it in items]
            tpp = self.geo.tokens_per_page
            return [s.index for s in slots], [min(len(s.groups), -(-s.held // tpp)) * tpp for s in slots]

    # -- observability ------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            geo, d, table, counters = self.geo, self.driver.stats, self.table, self.pages.counters
            free = self.growth.free_units()
            used, mapped_groups = geo.num_groups - free, geo.num_groups - self.free_pages.num_free
            return CacheStats(
                backend=self.name, unit_name=self.unit_name, tokens_per_unit=geo.tokens_per_page,
                total_units=geo.num_groups, used_units=used, free_units=free, live_tokens=table.live_tokens,
                allocated_token_slots=used * geo.tokens_per_page, reserved_bytes=d.reserved_bytes,
                mapped_bytes=mapped_groups * geo.num_tensors * geo.page_size, num_mappings=d.num_mappings,
                map_calls=d.map_calls, unmap_calls=d.unmap_calls, map_seconds=d.map_seconds,
                unmap_seconds=d.unmap_seconds, cow_copies=counters.cow_copies,
                prefix_hit_tokens=self.prefix.hit_tokens if self.prefix is not None else 0,
                swapped_out_bytes=counters.swapped_out_bytes, swapped_in_bytes=counters.swapped_in_bytes,
                allocator_seconds=self.allocator_seconds,
                extra={"driver": self.driver.name, "page_size": geo.page_size, "max_len": geo.max_len,
                       "pages": mapped_groups * geo.num_tensors, "pool_pages": geo.num_groups * geo.num_tensors,
                       "mapped_va_pages": d.mapped_pages, "pages_mapped": d.pages_mapped,
                       "pages_unmapped": d.pages_unmapped, "mapping_limit": self.driver.mapping_limit,
                       "reclaimable_units": table.excess, "live_slots": len(table.slot_of),
                       "stale_slots": len(table.stale), "background_seconds": self.mapper.seconds,
                       "mapper_calls": self.mapper.calls,
                       "per_place_fallbacks": d.per_place_fallbacks, "torn_pages": len(self.pages.calls.torn),
                       "map_refusals": d.map_refusals, "deferred_releases": d.deferred_releases,
                       **(self.prefix.stats() if self.prefix is not None else {"prefix_caching": "off"}),
                       **({"pool": pool} if (pool := self.pool.stats()) else {}),
                       **{k: getattr(counters, k) for k in COUNTER_EXTRAS}})

    def snapshot(self) -> dict[str, Any]:
        """Plain data: the geometry, each slot (owner, held tokens, page groups: -1 for the `dropped` leading pages a
        sliding window unmapped), group reference counts, swapped
        sequences (tokens), in-flight background jobs, what the driver maps in each tensor's place (page -> pool
        page) and its mapping counts, all read at once under the lock."""
        with self._lock:   # the background mapper changes the books under this lock
            geo = self.geo
            return {
                "geometry": dataclasses.asdict(geo) | {"row_bytes": geo.row_bytes, "tensor_bytes": geo.tensor_bytes,
                                                      "max_len": geo.max_len},
                "slots": [{"index": s.index, "seq_id": s.seq_id, "held": s.held, "groups": list(s.groups),
                       "dropped": s.dropped}
                          for s in self.table.slots],
                "slot_of": dict(self.table.slot_of),
                "refs": list(self.free_pages.refs),
                "swapped": {sid: kv.tokens for sid, kv in self.swap.swapped.items()},
                "pending": self.mapper.in_flight(),
                "put_off": [list(spot) for spots in self.pages.calls.put_off.values() for spot in spots],
                "places": [{"offset": offset, "mapped": dict(region.mapped)}   # no addresses: ranks compare it
                           for region, offset in self.ranges.places],
                "reclaimable_units": self.table.excess,
                "idle_cached": list(self.prefix.cache.idle) if self.prefix is not None else [],
                "free_groups": self.free_pages.num_free,
                "driver": {"mapped_pages": self.driver.stats.mapped_pages, "store_maps": list(self.driver.store_maps)},
            }

    def check_invariants(self) -> None:
        with self._lock:
            self.free_pages.check(self.table.slots)
            self.table.check(self.free_pages.is_shared)
            needed = {g for s in self.table.live() for g in s.groups[s.dropped:self.geo.pages_for(s.held)]}
            free = self.free_pages
            assert free.num_free + len(needed) + self.table.excess + free.num_idle() == self.geo.num_groups, \
                "free + used + reclaimable + idle cached != total pages"
            self.ranges.check_mapped(self.driver, self.geo, self.table.slots, self.pages.calls.put_off)

    def close(self) -> None:
        """Stop the mapper and release the driver (a range a view still reads is released when that view dies)."""
        if self.closed:
            return
        error = self.mapper.close()
        with self._lock:                 # a give-back running on the pool's steward thread finishes first
            self.closed = self.give_back.closed = True
        self.driver.close()
        if error is not None:
            raise error



def _any_units(units: int) -> bool:
    return True


def _close_quietly(driver: VirtualMemory) -> None:
    """Release the driver after a failed start-up; the start-up error is the one to report."""
    try:
        driver.close()
    except Exception as exc:  # noqa: BLE001 - the construction error is the one to report
        log.error("vmm: releasing the driver after a failed start-up also failed: %s", exc)
