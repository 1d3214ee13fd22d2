"""vAttention-style KV cache: per layer, K and V are contiguous virtual tensors [max_seqs, max_len, H_kv, D];
physical pages are mapped into a sequence's row (its slot) as it grows, so unmodified contiguous kernels run on them.

A unit is a page group: one page in each of the 2L tensors (vmm/geometry.py). This class composes the pieces:
the page pool (vmm/page_pool.py), the slots (vmm/slots.py), the virtual tensors (vmm/tensors.py), the moves of
pages between them (vmm/slot_pages.py) and the background mapper (vmm/mapper.py).
Unlike vAttention (anchors.md §1.6) every error raises, a lock guards all page-table state, the background mapper
is fenced and its errors reach the caller, pages can be shared between forks (copy-on-write) and swapped out.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kvlab.common.attention.dispatch import AttentionSpec
from kvlab.common.attention.metadata import BatchItem, ContiguousMetadata, base_metadata
from kvlab.common.errors import OutOfKVCache, RequestError
from kvlab.common.kv.seam import Allocator, CacheStats, KVCache, KVShape, Storage
from kvlab.vmm.geometry import make_driver, make_geometry
from kvlab.vmm.mapper import BackgroundMapper
from kvlab.vmm.page_pool import PagePool
from kvlab.vmm.slot_pages import SlotPages
from kvlab.vmm.slots import Slot, SlotTable
from kvlab.vmm.tensors import VirtualTensors

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.driver import VirtualMemory

log = logging.getLogger("kvlab.vmm")


@dataclass(slots=True)
class SwappedKV:
    tokens: int
    data: torch.Tensor | None     # [2L, tokens, H_kv, D] on the host; None in accounting mode


class VMMKVCache(Allocator, Storage):
    name = "vmm"
    unit_name = "page"

    def __init__(self, config: EngineConfig, shape: KVShape, accounting_only: bool = False, *,
                 single_range: bool | None = None, driver: VirtualMemory | None = None) -> None:
        self.config, self.shape, self.accounting_only = config, shape, accounting_only
        self._lock = threading.RLock()
        self.driver = driver or make_driver(shape.device, config.options_of("vmm").page_size, accounting_only)
        try:
            self._build(config.options_of("vmm").vmm_single_range if single_range is None else single_range)
        except BaseException:
            self._close_driver_quietly()
            raise
        if config.enable_prefix_caching:
            log.warning("vmm backend: prefix caching is not supported; every allocation reports 0 cached tokens")

    def _build(self, single_range: bool) -> None:
        geo = self.geo = make_geometry(self.config, self.shape, self.driver.page_size)
        self.tokens_per_unit = geo.tokens_per_page
        self._max_len = geo.max_len   # read on every per-step call (a property of the geometry)
        self.tensors = VirtualTensors(self.driver, geo, self.shape, single_range)
        self.driver.create_pool(geo.num_tensors * geo.num_groups)
        self.pool = PagePool(geo.num_groups)
        self.table = SlotTable(geo)
        self._counters = {"cow_copies": 0, "swapped_out_bytes": 0, "swapped_in_bytes": 0, "reclaimed_units": 0,
                          "lookahead_pages": 0, "lookahead_skipped": 0}
        self.pages = SlotPages(geo, self.driver, self.tensors, self.pool, self.table, self._counters)
        self.mapper = BackgroundMapper(geo, self._lock, self.pages.map_ahead, self.config.options_of("vmm").background_mapping)
        self._swapped: dict[int, SwappedKV] = {}
        self._alloc_seconds = 0.0
        self._step: tuple[ContiguousMetadata, torch.Tensor] | None = None
        self.dispatcher = None
        if not self.accounting_only:
            self.tensors.make_views()
            from kvlab.common.attention.dispatch import make_dispatcher
            spec = AttentionSpec(layout="contiguous", device=self.shape.device, dtype=self.shape.dtype,
                                 head_dim=self.shape.head_dim, num_q_heads=self.shape.num_q_heads,
                                 num_kv_heads=self.shape.num_kv_heads)
            self.dispatcher = make_dispatcher(spec, self.config.kernel)

    # views and tables under the names callers read (tests/invariants.py also reads the private ones)
    slots = property(lambda self: self.table.slots)
    k_caches = property(lambda self: self.tensors.k_caches)
    v_caches = property(lambda self: self.tensors.v_caches)
    _slot_of = property(lambda self: self.table.slot_of)
    _refs = property(lambda self: self.pool.refs)
    _place = property(lambda self: self.tensors.place)
    _pending = property(lambda self: self.mapper.pending)

    # -- capacity -----------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.geo.num_groups

    def num_free_units(self) -> int:
        with self._lock:   # the background mapper moves pages from the pool to a slot's tail
            return self.pool.num_free + self.table.excess

    def max_tokens_per_seq(self) -> int:
        return min(self.geo.num_groups * self.geo.tokens_per_page, self.geo.max_len)

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        with self._lock:
            slot = self.table.of(seq.seq_id)
            if slot is None:
                return self.geo.pages_for(num_tokens)
            return self._units_to_grow(slot, seq, num_tokens)

    def _units_to_grow(self, slot: Slot, seq: Sequence, num_tokens: int) -> int:
        tpp = self.tokens_per_unit
        grow = -(-num_tokens // tpp) + slot.held // -tpp   # pages for num_tokens - pages for the held tokens
        if self.pool.num_shared:
            return max(0, grow) + len(self.pages.shared_pages(slot, seq.num_computed_tokens, num_tokens))
        return max(0, grow)

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> bool:
        with self._lock:   # asked for every running sequence every step: no scans
            if num_tokens > self._max_len:
                return False
            index = self.table.slot_of.get(seq.seq_id)
            if index is None:
                if not self.table.has_free():
                    return False
                need = self.geo.pages_for(num_tokens)
            else:
                need = self._units_to_grow(self.table.slots[index], seq, num_tokens)
            return need + reserve_units <= self.pool.num_free + self.table.excess

    def _check_room(self, seq: Sequence, units: int) -> None:
        if seq.seq_id not in self.table.slot_of and not self.table.has_free():
            raise OutOfKVCache(f"no free vmm slot for sequence {seq.seq_id} (max_num_seqs={self.geo.num_slots})")
        if units > self.num_free_units():
            raise OutOfKVCache(f"sequence {seq.seq_id} needs {units} more pages but {self.num_free_units()} of "
                               f"{self.geo.num_groups} are free")

    # -- lifecycle ----------------------------------------------------------------------------------------
    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.table.slot_of

    def _take(self, seq: Sequence, num_tokens: int) -> int:
        if self.mapper.pending:
            self._fence(seq)
        with self._lock:
            t0 = time.perf_counter()
            try:
                index = self.table.slot_of.get(seq.seq_id)
                if index is not None and not self.pool.num_shared and num_tokens <= self._max_len:
                    slot = self.table.slots[index]   # the per-step path: are the pages already mapped?
                    if -(-num_tokens // self.tokens_per_unit) <= len(slot.groups) and seq.seq_id not in self._swapped:
                        if num_tokens > slot.held:
                            self.table.hold(slot, num_tokens)
                        if self.mapper.enabled:
                            self.mapper.request(slot, num_tokens)
                        return 0
                return self._allocate(seq, num_tokens)
            finally:
                self._alloc_seconds += time.perf_counter() - t0

    def _allocate(self, seq: Sequence, num_tokens: int) -> int:
        if num_tokens > self._max_len:
            raise OutOfKVCache(f"sequence {seq.seq_id} needs {num_tokens} tokens but a vmm slot holds at most "
                               f"{self.geo.max_len} (max_model_len rounded up to whole pages)")
        if seq.seq_id in self._swapped:
            raise RequestError(f"sequence {seq.seq_id} is swapped out; swap_in before allocate")
        self._check_room(seq, self.units_needed(seq, num_tokens))
        slot = self.table.of(seq.seq_id)
        claimed = slot is None
        if claimed:
            slot = self.table.claim(seq.seq_id, num_tokens)
        try:
            self.pages.copy_on_write(slot, seq.num_computed_tokens, num_tokens)
            self.pages.grow(slot, self.geo.pages_for(num_tokens))
        except BaseException:
            if claimed:   # a failed first allocation leaves the sequence holding nothing
                self.pages.release(slot)
            raise
        self.table.hold(slot, max(slot.held, num_tokens))
        self.mapper.request(slot, num_tokens)
        return 0

    def free(self, seq: Sequence) -> None:
        try:
            self._fence(seq)
        finally:   # a background error surfaces here, but the sequence is freed all the same
            with self._lock, self._timed():
                self._swapped.pop(seq.seq_id, None)
                slot = self.table.of(seq.seq_id)
                if slot is not None:
                    self.pages.release(slot)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._fence(parent)
        with self._lock, self._timed():
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

    def swap_out(self, seq: Sequence) -> None:
        self._fence(seq)
        with self._lock, self._timed():
            slot = self.table.of(seq.seq_id)
            if slot is None:
                raise RequestError(f"cannot swap out sequence {seq.seq_id}: it holds no vmm slot")
            tokens = min(seq.num_computed_tokens, slot.held)
            data = None if self.accounting_only else self.tensors.copy_out(slot.index, tokens)
            self._swapped[seq.seq_id] = SwappedKV(tokens, data)
            self.pages.release(slot)
            self._counters["swapped_out_bytes"] += tokens * self.shape.bytes_per_token

    def _swap_in(self, seq: Sequence) -> None:
        with self._lock, self._timed():
            saved = self._swapped.get(seq.seq_id)
            if saved is None:
                raise RequestError(f"cannot swap in sequence {seq.seq_id}: it was not swapped out")
            if seq.seq_id in self.table.slot_of:
                raise RequestError(f"cannot swap in sequence {seq.seq_id}: it already holds a slot")
            self._check_room(seq, self.geo.pages_for(saved.tokens))
            slot = self.table.claim(seq.seq_id, saved.tokens)
            try:
                self.pages.grow(slot, self.geo.pages_for(saved.tokens))
            except BaseException:
                self.pages.release(slot)
                raise
            self.table.hold(slot, saved.tokens)
            if saved.data is not None:
                self.tensors.copy_in(slot.index, saved.data)
            del self._swapped[seq.seq_id]
            self._counters["swapped_in_bytes"] += saved.tokens * self.shape.bytes_per_token

    def _fence(self, *seqs: Sequence) -> None:
        self.mapper.fence([self.table.slot_of.get(seq.seq_id) for seq in seqs])

    # -- one step -----------------------------------------------------------------------------------------
    def prepare(self, items: list[BatchItem]) -> ContiguousMetadata:
        self._fence(*(it.seq for it in items))
        with self._lock:
            if self.config.check_invariants:
                self.check_invariants()
            slots = [self._covering_slot(it) for it in items]
            # readable: up to the last page the held tokens need. Pages past it (mapped ahead, parked) are
            # reclaimable by any allocate, so they are not promised to the kernel.
            tpp, rows = self.geo.tokens_per_page, self.table.slots
            readable = [min(len(rows[i].groups), -(-rows[i].held // tpp)) * tpp for i in slots]
        device = self.shape.device
        meta = ContiguousMetadata(**base_metadata(items, device),
                                  slots=torch.tensor(slots, dtype=torch.int64, device=device),
                                  readable_lens=torch.tensor(readable, dtype=torch.int64, device=device))
        self._step = (meta, meta.slots.repeat_interleave(meta.query_lens.to(torch.int64)))
        return meta

    def _covering_slot(self, item: BatchItem) -> int:
        slot = self.table.of(item.seq.seq_id)
        if slot is None:
            raise RequestError(f"sequence {item.seq.seq_id} holds no vmm slot; allocate it before prepare")
        mapped = min(len(slot.groups) * self.geo.tokens_per_page, slot.held)
        if item.context_len > mapped:
            raise RequestError(f"sequence {item.seq.seq_id}: positions up to {item.context_len} are not allocated "
                               f"({mapped} are); call allocate(seq, {item.context_len}) before prepare")
        return slot.index

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: ContiguousMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        if self._step is not None and self._step[0] is meta:
            token_slots = self._step[1]
        else:
            token_slots = meta.slots.repeat_interleave(meta.query_lens.to(torch.int64))
        index = (token_slots, meta.input_positions)
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
        if self.config.check_invariants:
            self.check_invariants()
            for item in meta.items:
                self._covering_slot(item)
        return self.dispatcher.run(meta.phase, q, k_cache, v_cache, meta, scale)

    # -- observability ------------------------------------------------------------------------------------
    @contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._alloc_seconds += time.perf_counter() - t0

    def stats(self) -> CacheStats:
        with self._lock:
            geo, d, table = self.geo, self.driver.stats, self.table
            used = geo.num_groups - self.num_free_units()
            mapped_groups = geo.num_groups - self.pool.num_free
            return CacheStats(
                backend=self.name, unit_name=self.unit_name, tokens_per_unit=geo.tokens_per_page,
                total_units=geo.num_groups, used_units=used, free_units=self.num_free_units(),
                live_tokens=table.live_tokens, allocated_token_slots=used * geo.tokens_per_page,
                reserved_bytes=d.reserved_bytes, mapped_bytes=mapped_groups * geo.num_tensors * geo.page_size,
                num_mappings=d.num_mappings, map_calls=d.map_calls, unmap_calls=d.unmap_calls,
                map_seconds=d.map_seconds, unmap_seconds=d.unmap_seconds,
                cow_copies=self._counters["cow_copies"],
                swapped_out_bytes=self._counters["swapped_out_bytes"],
                swapped_in_bytes=self._counters["swapped_in_bytes"], allocator_seconds=self._alloc_seconds,
                extra={"driver": self.driver.name, "page_size": geo.page_size, "max_len": geo.max_len,
                       "pages": mapped_groups * geo.num_tensors, "pool_pages": geo.num_groups * geo.num_tensors,
                       "mapped_va_pages": d.mapped_pages, "pages_mapped": d.pages_mapped,
                       "pages_unmapped": d.pages_unmapped, "mapping_limit": self.driver.mapping_limit,
                       "reclaimable_units": table.excess, "live_slots": len(table.slot_of),
                       "stale_slots": len(table.stale),
                       "background_seconds": self.mapper.seconds,
                       "per_place_fallbacks": getattr(self.driver, "per_place_fallbacks", 0),
                       "prefix_caching": "unsupported" if self.config.enable_prefix_caching else "off",
                       **{k: v for k, v in self._counters.items() if k not in CacheStats.__slots__}})

    def kernel_report(self) -> dict:
        return self.dispatcher.report() if self.dispatcher is not None else {}

    def check_invariants(self) -> None:
        with self._lock:
            self.pool.check(self.table.slots)
            self.table.check(self.pool.is_shared)
            needed = {g for s in self.table.live() for g in s.groups[:self.geo.pages_for(s.held)]}
            assert self.pool.num_free + len(needed) + self.table.excess == self.geo.num_groups, \
                "free + used + reclaimable != total pages"
            self.tensors.check_mapped(self.table.slots)

    # -- teardown -----------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def close(self) -> None:
        if self.closed:
            return
        error = self.mapper.close()
        self.tensors.drop_views()
        self._step = None
        self.driver.close()   # refuses (DriverError) while a caller still holds a view of the cache
        self._closed = True
        if error is not None:
            raise error

    def _close_driver_quietly(self) -> None:
        if hasattr(self, "tensors"):   # absent when construction failed before the ranges were reserved
            self.tensors.drop_views()
        try:
            self.driver.close()
        except Exception as exc:  # noqa: BLE001 - the construction error is the one to report
            log.error("vmm: releasing the driver after a failed start-up also failed: %s", exc)

    # -- the allocator contract: check and take in one call ------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        if not self.can_allocate(seq, num_tokens, reserve_units):
            return None
        return self._take(seq, num_tokens)

    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        if not self.can_swap_in(seq, reserve_units):
            return False
        self._swap_in(seq)
        return True

    def can_swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        return self.can_allocate(seq, seq.num_computed_tokens, reserve_units)

    def snapshot(self) -> dict:
        return {}


def build_vmm(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    cache = VMMKVCache(config, shape, accounting_only)
    return KVCache(allocator=cache, storage=cache, shape=shape)
