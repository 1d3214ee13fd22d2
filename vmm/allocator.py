"""The vmm allocator (the scheduler's side): per layer, K and V are contiguous virtual tensors
[max_seqs, max_len, H_kv, D]; physical pages are mapped into a sequence's row (its slot) as it grows, so
unmodified contiguous kernels run on them (vmm/storage.py).

A unit is a page group: one page in each of the 2L tensors (vmm/geometry.py). This class composes the pieces:
the ranges (vmm/views.py), the pages (vmm/pages.py), the slots (vmm/slots.py) and the background mapper
(vmm/mapper.py). Unlike vAttention (anchors.md §1.6) every error raises, a lock guards all page-table state, the
background mapper is fenced and its errors reach the caller, pages can be shared between forks (copy-on-write)
and swapped out. With the accounting driver and `NoViews` (the simulator) the same code runs with no memory.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvlab.common.errors import ConfigError, OutOfKVCache, RequestError
from kvlab.common.kv.seam import Allocator, timed, timed_allocate
from kvlab.common.kv.types import CacheStats, KVShape
from kvlab.vmm.drivers.map_budget import MapBudgetExhausted
from kvlab.vmm.geometry import make_geometry
from kvlab.vmm.mapper import BackgroundMapper
from kvlab.vmm.pages import PagePool, SlotPages
from kvlab.vmm.prefix import PagePrefixCache
from kvlab.vmm.slots import Slot, SlotTable
from kvlab.vmm.views import NoViews, PageData, Ranges

if TYPE_CHECKING:
    from kvlab.common.attention.metadata import BatchItem
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.geometry import Geometry

log = logging.getLogger("kvlab.vmm")

DataFactory = Callable[["VirtualMemory", "Geometry", KVShape, Ranges], PageData]


@dataclass(slots=True)
class SwappedKV:
    tokens: int
    data: torch.Tensor | None     # [2L, tokens - dropped pages' tokens, H_kv, D] on the host; None without views
    dropped: int = 0              # leading pages the sliding window had unmapped: not saved, not mapped back


class VMMAllocator(Allocator):
    """Slots, pages and the driver behind them. `data` builds the K/V bytes over the ranges (`KVViews`), or none
    (`NoViews`); the storage reads them as `data`. 30 methods, one class because they all guard the same books
under one lock (the background mapper's): the seam's 15, prefix aliasing (match, register, claim, stats), the
map-budget retry and mapper job, and the step-side reads the storage uses (rows, covering slot)."""

    name = "vmm"
    unit_name = "page"

    def __init__(self, config: EngineConfig, shape: KVShape, driver: VirtualMemory, data: DataFactory = NoViews,
                 single_range: bool | None = None) -> None:
        opts = config.options_of("vmm")
        self.config, self.shape, self.driver = config, shape, driver
        self.window = shape.sliding_window   # None: full attention, no page is ever unmapped below it
        if self.window is not None and config.enable_prefix_caching:
            raise ConfigError("vmm: prefix caching with a sliding-window model is not supported (the window unmaps "
                              "the leading pages a prefix hit would share); disable one of them")
        self._lock = threading.RLock()
        try:
            geo = self.geo = make_geometry(config, shape, driver.page_size)
            self.ranges = Ranges.reserve(driver, geo, opts.vmm_single_range if single_range is None else single_range)
            driver.create_pool(geo.num_tensors * geo.num_groups)
            self.data = data(driver, geo, shape, self.ranges)
        except BaseException:
            self._close_driver_quietly()
            raise
        self.tokens_per_unit = geo.tokens_per_page
        self.prefix = PagePrefixCache(geo.tokens_per_page) if config.enable_prefix_caching else None
        self.pool, self.table = PagePool(geo.num_groups, self.prefix), SlotTable(geo)
        self.pages = SlotPages(geo, driver, self.ranges.mirror, self.data, self.pool, self.table)
        self.mapper = BackgroundMapper(geo, self._lock, self._map_ahead, opts.background_mapping)
        self.swapped: dict[int, SwappedKV] = {}
        self.closed = False
        self.prefix_hit_tokens = 0
        self.owners: dict[int, Sequence] = {}   # with prefix caching: the live sequences, to register their pages
        self.plain = self.prefix is None and self.window is None    # allocate's in-place path applies

    # -- capacity -----------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.geo.num_groups

    def num_free_units(self) -> int:
        with self._lock:   # the background mapper moves pages from the pool to a slot's tail
            return self.pool.num_free + self.table.excess + self.pool.num_idle()

    def max_tokens_per_seq(self) -> int:
        return min(self.geo.num_groups * self.geo.tokens_per_page, self.geo.max_len)

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        with self._lock:
            slot = self.table.of(seq.seq_id)
            if slot is None:
                return self._units_to_admit(seq, num_tokens)
            return self._units_to_grow(slot, seq, num_tokens)

    def _units_to_admit(self, seq: Sequence, num_tokens: int) -> int:
        """Pages a first allocation takes: prefix hits mapped in another slot cost nothing, idle ones a unit."""
        need = self.geo.pages_for(num_tokens)
        saved = self.swapped.get(seq.seq_id)
        if saved is not None:   # swap_in restores its own pages (no aliasing), none below its window
            return need - saved.dropped
        if self.prefix is None:
            return need
        hits = self._match(seq, num_tokens)
        return need - len(hits) + self.prefix.idle_hits(hits)

    def _match(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Cached leading pages of a new sequence, after registering what live sequences computed since their
        last allocate (as paged does: a prompt admitted next to its twin still hits)."""
        for owner in self.owners.values():
            slot = self.table.of(owner.seq_id)
            if slot is not None:
                self._register(owner, slot)
        return self.prefix.match(seq, num_tokens)

    def _units_to_grow(self, slot: Slot, seq: Sequence, num_tokens: int) -> int:
        tpp = self.tokens_per_unit
        grow = -(-num_tokens // tpp) + slot.held // -tpp   # pages for num_tokens - pages for the held tokens
        if self.pool.num_shared:
            return max(0, grow) + len(self.pages.shared_pages(slot, seq.num_computed_tokens, num_tokens))
        return max(0, grow)

    def _fits(self, seq: Sequence, num_tokens: int, reserve_units: int) -> bool:
        with self._lock:   # asked for every running sequence every step: no scans
            if num_tokens > self.geo.max_len:
                return False
            index = self.table.slot_of.get(seq.seq_id)
            if index is None:
                if not self.table.has_free():
                    return False
                need = self._units_to_admit(seq, num_tokens)
            else:
                need = self._units_to_grow(self.table.slots[index], seq, num_tokens)
            return need + reserve_units <= self.pool.num_free + self.table.excess + self.pool.num_idle()

    # -- lifecycle ----------------------------------------------------------------------------------------
    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.table.slot_of

    @timed_allocate
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        if self.plain and not reserve_units and self._grow_in_place(seq, num_tokens):
            return 0
        if not self._fits(seq, num_tokens, reserve_units):
            return None
        if self.mapper.pending:
            self._fence(seq)
        with self._lock:
            if seq.seq_id in self.swapped:
                raise RequestError(f"sequence {seq.seq_id} is swapped out; swap_in before allocate")
            slot = self.table.of(seq.seq_id)
            if slot is not None and self.prefix is not None:
                self._register(seq, slot)
            if slot is not None and self.window is not None:
                self._drop_below_window(slot, seq.num_computed_tokens)
            hit = 0
            if slot is not None and not self.pool.num_shared and self.geo.pages_for(num_tokens) <= len(slot.groups):
                if num_tokens > slot.held:   # the per-step path: the pages are already mapped
                    self.table.hold(slot, num_tokens)
            else:
                hit = self._grow_in_map_budget(seq, slot, num_tokens)
                if hit is None:
                    return None
            if self.mapper.enabled:
                self.mapper.request(self.table.of(seq.seq_id), num_tokens)
            return hit

    def _grow_in_place(self, seq: Sequence, num_tokens: int) -> bool:
        """The per-step decode path (no prefix cache, window, shared page or mapping in flight): the slot's
        mapped pages already cover `num_tokens`, so it only holds more of them. False: take the full path."""
        with self._lock:
            index = self.table.slot_of.get(seq.seq_id)
            if index is None or self.pool.num_shared or self.mapper.pending:
                return False
            slot = self.table.slots[index]
            if num_tokens > len(slot.groups) * self.tokens_per_unit:   # (a slot maps at most max_len tokens)
                return False
            if num_tokens > slot.held:
                self.table.hold(slot, num_tokens)
            if self.mapper.enabled:
                self.mapper.request(slot, num_tokens)
            return True

    def _drop_below_window(self, slot: Slot, computed: int) -> None:
        """Sliding window: this step's queries start at `computed` (later steps' further on), so they read keys from
        computed - W + 1 on; pages wholly below that are unmapped and go back to the pool. A sequence then maps at
        most ceil(W / tokens_per_page) + 1 pages during decode."""
        first_needed = max(min(computed, slot.held) - self.window + 1, 0)
        end = min(first_needed // self.geo.tokens_per_page, len(slot.groups))
        if end > slot.dropped:
            self.pages.drop_below(slot, end)

    def _register(self, seq: Sequence, slot: Slot) -> None:
        """Make the sequence's computed full pages findable by later prompts."""
        self.prefix.register(seq, slot.groups, min(seq.num_computed_tokens, slot.held, seq.num_tokens))

    def _claim(self, seq: Sequence, num_tokens: int) -> tuple[Slot, int]:
        """A slot for a first allocation, with its cached prefix pages aliased in; returns it and the hit tokens."""
        if self.prefix is None:
            return self.table.claim(seq.seq_id, num_tokens), 0
        hits = self._match(seq, num_tokens)
        slot = self.table.claim(seq.seq_id, num_tokens, fewest_pages=bool(hits))
        self.owners[seq.seq_id] = seq
        if not hits:
            return slot, 0
        tokens = len(hits) * self.geo.tokens_per_page
        try:
            self.pages.alias(slot, [g for g, _ in hits], tokens)
        except BaseException:
            self._release(seq.seq_id, slot)
            raise
        self.prefix.adopt(seq.seq_id, [h for _, h in hits])
        self.prefix_hit_tokens += tokens
        return slot, tokens

    def _grow_in_map_budget(self, seq: Sequence, slot: Slot | None, num_tokens: int) -> int | None:
        """`_grow`; out of OS mappings (MapBudgetExhausted, logged and counted), unmap the parked pages of freed
        slots, which gives their mappings back, and try once more; still out: None, nothing changed (out of room,
        like out of KV)."""
        try:
            return self._grow(seq, slot, num_tokens)
        except MapBudgetExhausted:
            if not self.table.stale:
                return None
        for index in list(self.table.stale):
            parked = self.table.slots[index]
            with self.table.accounting(parked):
                self.pages.drop_tail(parked, len(parked.groups))
        try:
            return self._grow(seq, self.table.of(seq.seq_id), num_tokens)
        except MapBudgetExhausted:
            return None

    def _grow(self, seq: Sequence, slot: Slot | None, num_tokens: int) -> int:
        claimed, hit = slot is None, 0
        if claimed:
            slot, hit = self._claim(seq, num_tokens)
        try:
            self.pages.copy_on_write(slot, max(seq.num_computed_tokens, hit), num_tokens)   # hits are not written
            self.pages.grow(slot, self.geo.pages_for(num_tokens))
        except BaseException:
            if claimed:   # a failed first allocation leaves the sequence holding nothing
                self._release(seq.seq_id, slot)
            raise
        self.table.hold(slot, max(slot.held, num_tokens))
        return hit

    def _map_ahead(self, index: int, seq_id: int, target: int) -> bool:
        """The background mapper's job: mapping ahead is skipped, not failed, when the OS mappings are spent."""
        try:
            return self.pages.map_ahead(index, seq_id, target)
        except MapBudgetExhausted:
            self.pages.counters.lookahead_skipped += 1
            return False

    def _release(self, seq_id: int, slot: Slot) -> None:
        if self.prefix is not None:
            self.prefix.forget(seq_id)
            self.owners.pop(seq_id, None)
        self.pages.release(slot)

    @timed
    def free(self, seq: Sequence) -> None:
        try:
            self._fence(seq)
        finally:   # a background error surfaces here, but the sequence is freed all the same
            with self._lock:
                self.swapped.pop(seq.seq_id, None)
                slot = self.table.of(seq.seq_id)
                if slot is not None:
                    if self.prefix is not None:
                        self._register(seq, slot)
                    self._release(seq.seq_id, slot)

    @timed
    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._fence(parent)
        with self._lock:
            source = self.table.of(parent.seq_id)
            if source is None:
                raise RequestError(f"cannot fork sequence {parent.seq_id}: it holds no vmm slot")
            if child.seq_id in self.table.slot_of:
                raise RequestError(f"cannot fork into sequence {child.seq_id}: it already holds a slot")
            if not self.table.has_free():
                raise OutOfKVCache(f"no free vmm slot for fork child {child.seq_id} (max_num_seqs="
                                   f"{self.geo.num_slots})")
            target = self.table.claim(child.seq_id, source.held, fewest_pages=True)
            try:
                self.pages.share(source, target)
            except BaseException:
                self.pages.release(target)
                raise
            if self.prefix is not None:
                self._register(parent, source)
                self.prefix.adopt(child.seq_id, self.prefix.chains.get(parent.seq_id, []))
                self.owners[child.seq_id] = child

    @timed
    def swap_out(self, seq: Sequence) -> None:
        self._fence(seq)
        with self._lock:
            slot = self.table.of(seq.seq_id)
            if slot is None:
                raise RequestError(f"cannot swap out sequence {seq.seq_id}: it holds no vmm slot")
            tokens = min(seq.num_computed_tokens, slot.held)
            dropped = min(slot.dropped, self.geo.pages_for(tokens))   # only the window's pages are saved
            start = min(dropped * self.geo.tokens_per_page, tokens)
            self.swapped[seq.seq_id] = SwappedKV(tokens, self.data.copy_out(slot.index, tokens, start), dropped)
            if self.prefix is not None:
                self._register(seq, slot)
            self._release(seq.seq_id, slot)
            self.pages.counters.swapped_out_bytes += (tokens - start) * self.shape.bytes_per_token

    @timed
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        if not self._fits(seq, seq.num_computed_tokens, reserve_units):
            return False
        with self._lock:
            saved = self.swapped.get(seq.seq_id)
            if saved is None:
                raise RequestError(f"cannot swap in sequence {seq.seq_id}: it was not swapped out")
            if seq.seq_id in self.table.slot_of:
                raise RequestError(f"cannot swap in sequence {seq.seq_id}: it already holds a slot")
            slot = self.table.claim(seq.seq_id, saved.tokens, fewest_pages=bool(saved.dropped))
            try:
                if saved.dropped:   # pages below the window stay unmapped
                    with self.table.accounting(slot):
                        self.pages.open_window(slot, saved.dropped)
                self.pages.grow(slot, self.geo.pages_for(saved.tokens))
            except BaseException as exc:
                self.pages.release(slot)
                if isinstance(exc, MapBudgetExhausted):   # out of OS mappings is out of room (logged, counted)
                    return False
                raise
            self.table.hold(slot, saved.tokens)
            if self.prefix is not None:
                self.owners[seq.seq_id] = seq
            start = min(saved.dropped * self.geo.tokens_per_page, saved.tokens)
            if saved.data is not None:
                self.data.copy_in(slot.index, saved.data, start)
            del self.swapped[seq.seq_id]
            self.pages.counters.swapped_in_bytes += (saved.tokens - start) * self.shape.bytes_per_token
            return True

    def _fence(self, *seqs: Sequence) -> None:
        self.mapper.fence([self.table.slot_of.get(seq.seq_id) for seq in seqs])

    # -- what the storage asks each step --------------------------------------------------------------------
    def rows(self, items: list[BatchItem], check: bool) -> tuple[list[int], list[int]]:
        """Each item's slot and readable length: up to the last page its held tokens need (pages past it, mapped
        ahead or parked, are reclaimable by any allocate, so they are not promised to a kernel). `check`: run
        check_invariants first. Raises RequestError if an item's context is not allocated."""
        self._fence(*(it.seq for it in items))
        with self._lock:
            if check:
                self.check_invariants()
            slots = [self._covering_slot(it) for it in items]
            tpp = self.geo.tokens_per_page
            return [s.index for s in slots], [min(len(s.groups), -(-s.held // tpp)) * tpp for s in slots]

    def _covering_slot(self, item: BatchItem) -> Slot:
        slot = self.table.of(item.seq.seq_id)
        if slot is None:
            raise RequestError(f"sequence {item.seq.seq_id} holds no vmm slot; allocate it before prepare")
        mapped = min(len(slot.groups) * self.geo.tokens_per_page, slot.held)
        if item.context_len > mapped:
            raise RequestError(f"sequence {item.seq.seq_id}: positions up to {item.context_len} are not allocated "
                               f"({mapped} are); call allocate(seq, {item.context_len}) before prepare")
        return slot

    # -- observability ------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            geo, d, table, counters = self.geo, self.driver.stats, self.table, self.pages.counters
            free = self.num_free_units()
            used, mapped_groups = geo.num_groups - free, geo.num_groups - self.pool.num_free
            return CacheStats(
                backend=self.name, unit_name=self.unit_name, tokens_per_unit=geo.tokens_per_page,
                total_units=geo.num_groups, used_units=used, free_units=free, live_tokens=table.live_tokens,
                allocated_token_slots=used * geo.tokens_per_page, reserved_bytes=d.reserved_bytes,
                mapped_bytes=mapped_groups * geo.num_tensors * geo.page_size, num_mappings=d.num_mappings,
                map_calls=d.map_calls, unmap_calls=d.unmap_calls, map_seconds=d.map_seconds,
                unmap_seconds=d.unmap_seconds, cow_copies=counters.cow_copies, prefix_hit_tokens=self.prefix_hit_tokens,
                swapped_out_bytes=counters.swapped_out_bytes, swapped_in_bytes=counters.swapped_in_bytes,
                allocator_seconds=self.allocator_seconds,
                extra={"driver": self.driver.name, "page_size": geo.page_size, "max_len": geo.max_len,
                       "pages": mapped_groups * geo.num_tensors, "pool_pages": geo.num_groups * geo.num_tensors,
                       "mapped_va_pages": d.mapped_pages, "pages_mapped": d.pages_mapped,
                       "pages_unmapped": d.pages_unmapped, "mapping_limit": self.driver.mapping_limit,
                       "reclaimable_units": table.excess, "live_slots": len(table.slot_of),
                       "stale_slots": len(table.stale), "background_seconds": self.mapper.seconds,
                       "per_place_fallbacks": getattr(self.driver, "per_place_fallbacks", 0),
                       "map_refusals": d.map_refusals, "deferred_releases": d.deferred_releases,
                       **self._prefix_stats(),
                       **{k: v for k, v in dataclasses.asdict(counters).items() if k not in CacheStats.__slots__}})

    def _prefix_stats(self) -> dict[str, Any]:
        cache = self.prefix
        if cache is None:
            return {"prefix_caching": "off"}
        return {"prefix_caching": "on", "prefix_cached_pages": len(cache), "prefix_idle_pages": len(cache.idle),
                "prefix_evictions": cache.evictions, "prefix_hash_collisions": cache.collisions}

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
                "refs": list(self.pool.refs),
                "swapped": {sid: kv.tokens for sid, kv in self.swapped.items()},
                "pending": sorted(self.mapper.pending),
                "places": [{"offset": offset, "mapped": dict(region.mapped)}   # no addresses: ranks compare it
                           for region, offset in self.ranges.places],
                "reclaimable_units": self.table.excess,
                "idle_cached": list(self.prefix.idle) if self.prefix is not None else [],
                "free_groups": self.pool.num_free,
                "driver": {"mapped_pages": self.driver.stats.mapped_pages, "pool_maps": list(self.driver.pool_maps)},
            }

    def check_invariants(self) -> None:
        with self._lock:
            self.pool.check(self.table.slots)
            self.table.check(self.pool.is_shared)
            needed = {g for s in self.table.live() for g in s.groups[s.dropped:self.geo.pages_for(s.held)]}
            assert self.pool.num_free + len(needed) + self.table.excess + self.pool.num_idle() == self.geo.num_groups, \
                "free + used + reclaimable + idle cached != total pages"
            self.ranges.check_mapped(self.driver, self.geo, self.table.slots)

    # -- teardown -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the mapper, drop the views, release the driver (refused while a caller holds a view)."""
        if self.closed:
            return
        error = self.mapper.close()
        self.data.drop()
        self.driver.close()
        self.closed = True
        if error is not None:
            raise error

    def _close_driver_quietly(self) -> None:
        if hasattr(self, "data"):
            self.data.drop()
        try:
            self.driver.close()
        except Exception as exc:  # noqa: BLE001 - the construction error is the one to report
            log.error("vmm: releasing the driver after a failed start-up also failed: %s", exc)
