"""vAttention-style KV cache: per layer, K and V are contiguous virtual tensors [max_seqs, max_len, H_kv, D];
physical pages are mapped into a sequence's row (its slot) as it grows, so unmodified contiguous kernels run on them.

A unit is a page group: one page in each of the 2L tensors. Group g is pool page t*G + g of tensor t, so groups
with consecutive ids are consecutive pool pages in every tensor and neighbouring mappings merge (host VMAs).
Unlike vAttention (anchors.md §1.6) every error raises, a lock guards all page-table state, the background mapper
is fenced and its errors reach the caller, pages can be shared between forks (copy-on-write) and swapped out.
"""
from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.errors import ConfigError, OutOfKVCache, RequestError
from common.kernel_spec import AttentionSpec
from common.kv_cache import BatchItem, CacheStats, ContiguousMetadata, KVCache, KVShape, base_metadata
from vmm.driver import AccountingVirtualMemory, Region, VirtualMemory

if TYPE_CHECKING:
    from common.config import EngineConfig
    from common.sequence import Sequence

log = logging.getLogger("kvlab.vmm")

LOOKAHEAD_FRACTION = 8   # background mapping starts when a sequence is within 1/8 page of its next page


@dataclass(slots=True)
class Slot:
    """One row of every virtual tensor. `groups[j]` is the page group mapped at page j (pages 0..len-1)."""
    index: int
    groups: list[int] = field(default_factory=list)
    seq_id: int | None = None     # owner; None = free (maybe stale: still holding the last owner's pages)
    held: int = 0                 # tokens the owner may write (the largest allocate target)
    freed_at: int = 0             # when it became free (oldest stale slots are reclaimed first)


@dataclass(slots=True)
class SwappedKV:
    tokens: int
    data: torch.Tensor | None     # [2L, tokens, H_kv, D] on the host; None in accounting mode


@dataclass(frozen=True, slots=True)
class Geometry:
    page_size: int
    tokens_per_page: int
    pages_per_slot: int
    num_slots: int
    num_tensors: int              # 2L: K_0..K_{L-1}, V_0..V_{L-1}
    num_groups: int               # G: capacity in units

    @property
    def max_len(self) -> int:
        return self.pages_per_slot * self.tokens_per_page

    @property
    def row_bytes(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def tensor_bytes(self) -> int:
        return self.num_slots * self.row_bytes


def make_geometry(config: EngineConfig, shape: KVShape, page_size: int) -> Geometry:
    per_token = shape.bytes_per_token_per_layer
    if page_size < per_token:
        raise ConfigError(f"page_size {page_size} B is smaller than one token's K for one layer ({per_token} B); "
                          "raise page_size")
    tpp = page_size // per_token
    tensors = 2 * shape.num_layers
    groups = config.kv_cache_bytes // (tensors * page_size)
    if groups < 1:
        raise ConfigError(f"kv_cache_bytes {config.kv_cache_bytes} holds no page group ({tensors} tensors x "
                          f"{page_size} B pages); raise kv_cache_bytes or lower page_size")
    return Geometry(page_size, tpp, -(-config.max_model_len // tpp), config.max_num_seqs, tensors, groups)


def make_driver(device: str, page_size: int, accounting_only: bool) -> VirtualMemory:
    kind = device.split(":")[0]
    if accounting_only:
        return AccountingVirtualMemory(page_size, merges=kind == "cpu")
    if kind == "cpu":
        from vmm.host import HostVirtualMemory
        return HostVirtualMemory(page_size)
    if kind == "cuda":
        from vmm.cuda import CudaVirtualMemory
        index = int(device.split(":")[1]) if ":" in device else (
            torch.cuda.current_device() if torch.cuda.is_available() else 0)
        return CudaVirtualMemory(index, page_size)
    raise ConfigError(f"unknown device {device!r} for the vmm backend; use cpu or cuda[:N]")


class VMMKVCache(KVCache):
    name = "vmm"
    unit_name = "page"

    def __init__(self, config: EngineConfig, shape: KVShape, accounting_only: bool = False, *,
                 single_range: bool = False, driver: VirtualMemory | None = None) -> None:
        super().__init__(config, shape, accounting_only)
        self._lock = threading.RLock()
        self.driver = driver or make_driver(shape.device, config.page_size, accounting_only)
        try:
            self._build(single_range)
        except BaseException:
            self._close_driver_quietly()
            raise
        if config.enable_prefix_caching:
            log.warning("vmm backend: prefix caching is not supported; every allocation reports 0 cached tokens")

    # -- construction -------------------------------------------------------------------------------------
    def _build(self, single_range: bool) -> None:
        geo = self.geo = make_geometry(self.config, self.shape, self.driver.page_size)
        self.tokens_per_unit = geo.tokens_per_page
        if single_range:
            whole = self.driver.reserve(geo.num_tensors * geo.tensor_bytes)
            self._place = [(whole, t * geo.tensor_bytes) for t in range(geo.num_tensors)]
        else:
            self._place = [(self.driver.reserve(geo.tensor_bytes), 0) for _ in range(geo.num_tensors)]
        self.driver.create_pool(geo.num_tensors * geo.num_groups)
        self.slots = [Slot(i) for i in range(geo.num_slots)]
        self._slot_of: dict[int, int] = {}
        self._swapped: dict[int, SwappedKV] = {}
        self._free = bytearray(b"\x01") * geo.num_groups   # 1 = group in the pool, unmapped
        self._num_free = geo.num_groups
        self._refs = array("i", [0]) * geo.num_groups      # slots mapping each group
        self._excess = 0                                   # mapped groups no live token needs (reclaimable)
        self._clock = 0
        self._counters = {"cow_copies": 0, "swapped_out_bytes": 0, "swapped_in_bytes": 0, "reclaimed_units": 0,
                          "lookahead_pages": 0, "lookahead_skipped": 0}
        self._alloc_seconds = 0.0
        self._background_seconds = 0.0
        self._pending: dict[int, Future] = {}
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="kvlab-vmm-mapper")
                          if self.config.background_mapping else None)
        self._step: tuple[ContiguousMetadata, torch.Tensor] | None = None
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self._page_bytes: list[torch.Tensor] = []
        self.dispatcher = None
        if not self.accounting_only:
            self._make_views()
            from common.kernels import make_dispatcher
            spec = AttentionSpec(layout="contiguous", device=self.shape.device, dtype=self.shape.dtype,
                                 head_dim=self.shape.head_dim, num_q_heads=self.shape.num_q_heads,
                                 num_kv_heads=self.shape.num_kv_heads)
            self.dispatcher = make_dispatcher(spec, self.config.kernel)

    def _make_views(self) -> None:
        geo, s = self.geo, self.shape
        dims = (geo.num_slots, geo.max_len, s.num_kv_heads, s.head_dim)
        strides = (geo.row_bytes // s.itemsize, s.num_kv_heads * s.head_dim, s.head_dim, 1)
        views = [self.driver.tensor_view(region, s.torch_dtype, dims, strides, offset)
                 for region, offset in self._place]
        self.k_caches, self.v_caches = views[:s.num_layers], views[s.num_layers:]
        self._page_bytes = [self.driver.tensor_view(region, torch.uint8, (geo.tensor_bytes,), offset=offset)
                            for region, offset in self._place]

    # -- capacity -----------------------------------------------------------------------------------------
    def _need(self, tokens: int) -> int:
        return -(-tokens // self.geo.tokens_per_page)

    def num_total_units(self) -> int:
        return self.geo.num_groups

    def num_free_units(self) -> int:
        with self._lock:   # the background mapper moves pages from the pool to a slot's tail
            return self._num_free + self._excess

    def max_tokens_per_seq(self) -> int:
        return min(self.geo.num_groups * self.geo.tokens_per_page, self.geo.max_len)

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        with self._lock:
            index = self._slot_of.get(seq.seq_id)
            if index is None:
                return self._need(num_tokens)
            slot = self.slots[index]
            grow = max(0, self._need(num_tokens) - self._need(slot.held))
            return grow + len(self._shared_pages(slot, seq.num_computed_tokens, num_tokens))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> bool:
        with self._lock:
            if num_tokens > self.geo.max_len:
                return False
            if seq.seq_id not in self._slot_of and not self._has_free_slot():
                return False
            return self.units_needed(seq, num_tokens) + reserve_units <= self.num_free_units()

    def _has_free_slot(self) -> bool:
        return len(self._slot_of) < self.geo.num_slots

    # -- lifecycle ----------------------------------------------------------------------------------------
    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self._slot_of

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        self._fence([self._slot_of.get(seq.seq_id)])
        with self._lock, self._timed():
            if num_tokens > self.geo.max_len:
                raise OutOfKVCache(f"sequence {seq.seq_id} needs {num_tokens} tokens but a vmm slot holds at most "
                                   f"{self.geo.max_len} (max_model_len rounded up to whole pages)")
            if seq.seq_id in self._swapped:
                raise RequestError(f"sequence {seq.seq_id} is swapped out; swap_in before allocate")
            self._check_room(seq, self.units_needed(seq, num_tokens))
            slot = self._slot(seq)
            claimed = slot is None
            if claimed:
                slot = self._claim_slot(seq.seq_id, num_tokens)
            try:
                self._copy_on_write(slot, seq.num_computed_tokens, num_tokens)
                self._grow(slot, self._need(num_tokens))
            except BaseException:
                if claimed:   # a failed first allocation leaves the sequence holding nothing
                    self._release_slot(slot)
                raise
            with self._accounting(slot):
                slot.held = max(slot.held, num_tokens)
            self._map_ahead_later(slot, num_tokens)
        return 0

    def free(self, seq: Sequence) -> None:
        try:
            self._fence([self._slot_of.get(seq.seq_id)])
        finally:   # a background error surfaces here, but the sequence is freed all the same
            with self._lock, self._timed():
                self._swapped.pop(seq.seq_id, None)
                slot = self._slot(seq)
                if slot is not None:
                    self._release_slot(slot)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._fence([self._slot_of.get(parent.seq_id)])
        with self._lock, self._timed():
            source = self._slot(parent)
            if source is None:
                raise RequestError(f"cannot fork sequence {parent.seq_id}: it holds no vmm slot")
            if child.seq_id in self._slot_of:
                raise RequestError(f"cannot fork into sequence {child.seq_id}: it already holds a slot")
            if not self._has_free_slot():
                raise OutOfKVCache(f"no free vmm slot for fork child {child.seq_id} (max_num_seqs="
                                   f"{self.geo.num_slots})")
            shared = source.groups[:self._need(source.held)]
            target = self._claim_slot(child.seq_id, source.held, fewest_pages=True)
            try:
                with self._accounting(target):
                    self._drop_tail(target, len(target.groups))   # its stale pages go back to the pool
                    self._map_pages(target, 0, shared)
                    target.groups.extend(shared)
                    for g in shared:
                        self._refs[g] += 1
                    target.held = source.held
            except BaseException:
                self._release_slot(target)
                raise

    def swap_out(self, seq: Sequence) -> None:
        self._fence([self._slot_of.get(seq.seq_id)])
        with self._lock, self._timed():
            slot = self._slot(seq)
            if slot is None:
                raise RequestError(f"cannot swap out sequence {seq.seq_id}: it holds no vmm slot")
            tokens = min(seq.num_computed_tokens, slot.held)
            data = None if self.accounting_only else self._copy_out(slot.index, tokens)
            self._swapped[seq.seq_id] = SwappedKV(tokens, data)
            self._release_slot(slot)
            self._counters["swapped_out_bytes"] += tokens * self.shape.bytes_per_token

    def swap_in(self, seq: Sequence) -> None:
        with self._lock, self._timed():
            saved = self._swapped.get(seq.seq_id)
            if saved is None:
                raise RequestError(f"cannot swap in sequence {seq.seq_id}: it was not swapped out")
            if seq.seq_id in self._slot_of:
                raise RequestError(f"cannot swap in sequence {seq.seq_id}: it already holds a slot")
            self._check_room(seq, self._need(saved.tokens))
            slot = self._claim_slot(seq.seq_id, saved.tokens)
            try:
                self._grow(slot, self._need(saved.tokens))
            except BaseException:
                self._release_slot(slot)
                raise
            with self._accounting(slot):
                slot.held = saved.tokens
            if saved.data is not None:
                self._copy_in(slot.index, saved.data)
            del self._swapped[seq.seq_id]
            self._counters["swapped_in_bytes"] += saved.tokens * self.shape.bytes_per_token

    def _check_room(self, seq: Sequence, units: int) -> None:
        if seq.seq_id not in self._slot_of and not self._has_free_slot():
            raise OutOfKVCache(f"no free vmm slot for sequence {seq.seq_id} (max_num_seqs={self.geo.num_slots})")
        if units > self.num_free_units():
            raise OutOfKVCache(f"sequence {seq.seq_id} needs {units} more pages but {self.num_free_units()} of "
                               f"{self.geo.num_groups} are free")

    # -- slots --------------------------------------------------------------------------------------------
    def _slot(self, seq: Sequence) -> Slot | None:
        index = self._slot_of.get(seq.seq_id)
        return None if index is None else self.slots[index]

    def _claim_slot(self, seq_id: int, tokens: int, fewest_pages: bool = False) -> Slot:
        """A free slot: the one whose stale pages best cover `tokens` (fewest pages for a fork child, whose
        pages are replaced by the parent's)."""
        need = self._need(tokens)
        free = [s for s in self.slots if s.seq_id is None]
        if fewest_pages:
            slot = min(free, key=lambda s: (len(s.groups), s.index))
        else:  # smallest covering slot, else the largest one (fewest new maps)
            slot = min(free, key=lambda s: (len(s.groups) < need, abs(len(s.groups) - need), s.index))
        with self._accounting(slot):
            slot.seq_id, slot.held = seq_id, 0
        self._slot_of[seq_id] = slot.index
        return slot

    def _release_slot(self, slot: Slot) -> None:
        """Free the slot but keep its exclusive pages mapped (deferred reclamation); drop shared pages."""
        with self._accounting(slot):
            shared = [j for j, g in enumerate(slot.groups) if self._refs[g] > 1]
            if shared:   # keep the exclusive prefix only, so a free slot never holds a shared page
                self._drop_tail(slot, len(slot.groups) - shared[0])
            del self._slot_of[slot.seq_id]
            slot.seq_id, slot.held = None, 0
            self._clock += 1
            slot.freed_at = self._clock

    def _excess_of(self, slot: Slot) -> int:
        if slot.seq_id is None:
            return len(slot.groups)
        return max(0, len(slot.groups) - self._need(slot.held))

    @contextmanager
    def _accounting(self, slot: Slot) -> Iterator[None]:
        """Keep the reclaimable-unit total in step with every change to a slot."""
        before = self._excess_of(slot)
        try:
            yield
        finally:
            self._excess += self._excess_of(slot) - before

    # -- pages --------------------------------------------------------------------------------------------
    def _shared_pages(self, slot: Slot, start: int, end: int) -> list[int]:
        """Pages of `slot` that writes to positions [start, end) touch and another slot also maps."""
        last = min(self._need(end), len(slot.groups))
        return [j for j in range(start // self.geo.tokens_per_page, last) if self._refs[slot.groups[j]] > 1]

    def _grow(self, slot: Slot, pages: int) -> None:
        missing = pages - len(slot.groups)
        if missing <= 0:
            return
        prefer = slot.groups[-1] + 1 if slot.groups else None
        new = self._obtain(missing, slot, keep=pages, prefer=prefer)
        with self._accounting(slot):
            self._map_pages(slot, len(slot.groups), new)
            slot.groups.extend(new)
            for g in new:
                self._refs[g] = 1

    def _copy_on_write(self, slot: Slot, start: int, end: int) -> None:
        for j in self._shared_pages(slot, start, end):
            old = slot.groups[j]
            prefer = slot.groups[j - 1] + 1 if j else None
            new = self._obtain(1, slot, keep=self._need(end), prefer=prefer)[0]
            saved = None if self.accounting_only else [b[self._page_span(slot.index, j)].clone()
                                                       for b in self._page_bytes]
            self._unmap_pages(slot, j, 1)
            try:
                self._map_pages(slot, j, [new])
            except BaseException:
                self._map_pages(slot, j, [old])   # put the shared page back; the slot stays consistent
                raise
            self._refs[old] -= 1
            slot.groups[j] = new
            self._refs[new] = 1
            if saved is not None:
                for b, data in zip(self._page_bytes, saved):
                    b[self._page_span(slot.index, j)].copy_(data)
            self._counters["cow_copies"] += 1

    def _obtain(self, count: int, requester: Slot, keep: int, prefer: int | None) -> list[int]:
        """`count` groups from the pool, reclaiming pages no live token needs when the pool runs short."""
        if self._num_free < count:
            self._reclaim(count - self._num_free, requester, keep)
        if self._num_free < count:   # unreachable if callers checked num_free_units(); never map half a request
            raise OutOfKVCache(f"need {count} pages, only {self._num_free} could be freed")
        return self._take_free(count, prefer)

    def _reclaim(self, count: int, requester: Slot, keep: int) -> None:
        """Unmap tail pages: oldest free (stale) slots first, then pages mapped ahead in live slots."""
        stale = sorted((s for s in self.slots if s.seq_id is None and s.groups), key=lambda s: s.freed_at)
        live = [s for s in self.slots if s.seq_id is not None and s is not requester]
        for slot in stale + live + [requester]:
            if count <= 0:
                return
            floor = keep if slot is requester else (0 if slot.seq_id is None else self._need(slot.held))
            n = min(count, len(slot.groups) - floor)
            if n > 0:
                with self._accounting(slot):
                    self._drop_tail(slot, n)
                count -= n
                self._counters["reclaimed_units"] += n

    def _take_free(self, count: int, prefer: int | None) -> list[int]:
        """Prefer the groups right after `prefer`, then the first run of `count` free groups, then any."""
        taken: list[int] = []

        def take(g: int) -> None:
            self._free[g] = 0
            taken.append(g)
        g = prefer if prefer is not None else self.geo.num_groups
        while len(taken) < count and g < self.geo.num_groups and self._free[g]:
            take(g)
            g += 1
        rest = count - len(taken)
        start = self._free.find(b"\x01" * rest) if rest else -1
        for g in range(start, start + rest) if start >= 0 else ():
            take(g)
        while len(taken) < count:
            take(self._free.find(b"\x01"))
        self._num_free -= count
        return taken

    def _drop_tail(self, slot: Slot, count: int) -> None:
        if count <= 0:
            return
        first = len(slot.groups) - count
        self._unmap_pages(slot, first, count)
        self._put_back(slot.groups[first:])
        del slot.groups[first:]

    def _put_back(self, groups: list[int]) -> None:
        for g in groups:
            self._refs[g] -= 1
            if self._refs[g] == 0:
                self._free[g] = 1
                self._num_free += 1

    # -- driver calls -------------------------------------------------------------------------------------
    def _page_offset(self, tensor: int, slot: int, page: int) -> int:
        return self._place[tensor][1] + slot * self.geo.row_bytes + page * self.geo.page_size

    def _page_span(self, slot: int, page: int) -> slice:
        start = slot * self.geo.row_bytes + page * self.geo.page_size
        return slice(start, start + self.geo.page_size)

    def _map_pages(self, slot: Slot, first_page: int, groups: list[int]) -> None:
        """Map `groups` at pages first_page.. of the slot in every tensor; all or nothing."""
        done: list[tuple[Region, int, int]] = []
        try:
            for start, n in self._group_runs(groups):
                for t, (region, _) in enumerate(self._place):
                    offset = self._page_offset(t, slot.index, first_page + start)
                    self.driver.map(region, offset, t * self.geo.num_groups + groups[start], n)
                    done.append((region, offset, n))
        except BaseException:
            for region, offset, n in done:
                self.driver.unmap(region, offset, n)
            for g in groups:   # groups fresh from the pool go back to it
                if self._refs[g] == 0 and not self._free[g]:
                    self._free[g] = 1
                    self._num_free += 1
            raise

    def _unmap_pages(self, slot: Slot, first_page: int, count: int) -> None:
        for t, (region, _) in enumerate(self._place):
            self.driver.unmap(region, self._page_offset(t, slot.index, first_page), count)

    @staticmethod
    def _group_runs(groups: list[int]) -> list[tuple[int, int]]:
        """(index, length) runs of consecutive group ids (each run is one map call per tensor)."""
        out: list[tuple[int, int]] = []
        for i, g in enumerate(groups):
            if out and groups[out[-1][0]] + out[-1][1] == g:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((i, 1))
        return out

    # -- background mapping -------------------------------------------------------------------------------
    def _map_ahead_later(self, slot: Slot, tokens: int) -> None:
        if self._executor is None:
            return
        ahead = max(1, self.geo.tokens_per_page // LOOKAHEAD_FRACTION)
        target = min(self._need(tokens + ahead), self.geo.pages_per_slot)
        if target > len(slot.groups) and slot.index not in self._pending:
            self._pending[slot.index] = self._executor.submit(self._map_ahead, slot.index, slot.seq_id, target)

    def _map_ahead(self, index: int, seq_id: int, target: int) -> None:
        """Worker thread: map pages the slot will need soon, from the free pool only (never reclaims)."""
        with self._lock:
            t0 = time.perf_counter()
            slot = self.slots[index]
            if slot.seq_id != seq_id or len(slot.groups) >= target:
                return
            count = min(target - len(slot.groups), self._num_free)
            if count <= 0:
                self._counters["lookahead_skipped"] += 1
                log.debug("background mapping skipped for slot %d: the pool is empty", index)
                return
            prefer = slot.groups[-1] + 1 if slot.groups else None
            new = self._take_free(count, prefer)
            with self._accounting(slot):
                self._map_pages(slot, len(slot.groups), new)
                slot.groups.extend(new)
                for g in new:
                    self._refs[g] = 1
            self._counters["lookahead_pages"] += count
            self._background_seconds += time.perf_counter() - t0

    def _fence(self, indices: list[int | None]) -> None:
        """Wait for in-flight mapping of these slots; re-raise any background error here, in the caller."""
        for index in indices:
            future = self._pending.pop(index, None) if index is not None else None
            if future is not None:
                future.result()
        for index, future in list(self._pending.items()):
            if future.done():
                del self._pending[index]
                future.result()

    # -- one step -----------------------------------------------------------------------------------------
    def prepare(self, items: list[BatchItem]) -> ContiguousMetadata:
        self._fence([self._slot_of.get(it.seq.seq_id) for it in items])
        with self._lock:
            if self.config.check_invariants:
                self.check_invariants()
            slots = [self._covering_slot(it) for it in items]
        meta = ContiguousMetadata(**base_metadata(items, self.shape.device),
                                  slots=torch.tensor(slots, dtype=torch.int64, device=self.shape.device))
        self._step = (meta, meta.slots.repeat_interleave(meta.query_lens.to(torch.int64)))
        return meta

    def _covering_slot(self, item: BatchItem) -> int:
        slot = self._slot(item.seq)
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

    # -- swap copies --------------------------------------------------------------------------------------
    def _copy_out(self, slot: int, tokens: int) -> torch.Tensor:
        s = self.shape
        pin = s.device.startswith("cuda") and torch.cuda.is_available()
        data = torch.empty((self.geo.num_tensors, tokens, s.num_kv_heads, s.head_dim), dtype=s.torch_dtype,
                           pin_memory=pin)
        for t, cache in enumerate(self.k_caches + self.v_caches):
            data[t].copy_(cache[slot, :tokens])
        return data

    def _copy_in(self, slot: int, data: torch.Tensor) -> None:
        tokens = data.shape[1]
        for t, cache in enumerate(self.k_caches + self.v_caches):
            cache[slot, :tokens].copy_(data[t], non_blocking=True)

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
            geo, d = self.geo, self.driver.stats
            live = [s for s in self.slots if s.seq_id is not None]
            used = geo.num_groups - self.num_free_units()
            mapped_groups = geo.num_groups - self._num_free
            return CacheStats(
                backend=self.name, unit_name=self.unit_name, tokens_per_unit=geo.tokens_per_page,
                total_units=geo.num_groups, used_units=used, free_units=self.num_free_units(),
                live_tokens=sum(s.held for s in live), allocated_token_slots=used * geo.tokens_per_page,
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
                       "reclaimable_units": self._excess, "live_slots": len(live),
                       "stale_slots": sum(1 for s in self.slots if s.seq_id is None and s.groups),
                       "background_seconds": self._background_seconds,
                       "prefix_caching": "unsupported" if self.config.enable_prefix_caching else "off",
                       **{k: v for k, v in self._counters.items() if k not in CacheStats.__slots__}})

    def kernel_report(self) -> dict:
        return self.dispatcher.report() if self.dispatcher is not None else {}

    def check_invariants(self) -> None:
        with self._lock:
            geo = self.geo
            refs = [0] * geo.num_groups
            for slot in self.slots:
                assert len(set(slot.groups)) == len(slot.groups), f"slot {slot.index} maps a group twice"
                for g in slot.groups:
                    refs[g] += 1
            assert list(self._refs) == refs, "page refcounts differ from the slots mapping them"
            for g in range(geo.num_groups):
                assert bool(self._free[g]) == (refs[g] == 0), f"group {g}: free flag and mappings disagree"
            assert self._num_free == sum(self._free), "free-page count drifted"
            assert self._excess == sum(self._excess_of(s) for s in self.slots), "reclaimable count drifted"
            self._check_slots()
            needed = {g for s in self.slots if s.seq_id is not None for g in s.groups[:self._need(s.held)]}
            assert self._num_free + len(needed) + self._excess == geo.num_groups, \
                "free + used + reclaimable != total pages"
            self._check_driver_agrees()

    def _check_slots(self) -> None:
        assert {s.seq_id: s.index for s in self.slots if s.seq_id is not None} == self._slot_of, \
            "slot owners and the sequence->slot table disagree"
        for s in self.slots:
            need = self._need(s.held) if s.seq_id is not None else 0
            assert len(s.groups) >= need, f"slot {s.index}: {s.held} live tokens but only {len(s.groups)} pages"
            for j, g in enumerate(s.groups):
                if self._refs[g] > 1:   # shared pages belong to live owners that need them
                    assert j < need, f"slot {s.index} page {j}: shared group {g} outside the live range"

    def _check_driver_agrees(self) -> None:
        """Every page the tables claim is mapped is mapped by the driver at the right pool page, and no other."""
        total = 0
        for slot in self.slots:
            for j, g in enumerate(slot.groups):
                for t, (region, _) in enumerate(self._place):
                    va = self._page_offset(t, slot.index, j) // self.geo.page_size
                    assert region.mapped.get(va) == t * self.geo.num_groups + g, \
                        f"slot {slot.index} page {j} tensor {t} is not mapped to group {g}"
            total += len(slot.groups) * self.geo.num_tensors
        assert self.driver.stats.mapped_pages == total, "the driver maps pages no slot accounts for"

    # -- teardown -----------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def close(self) -> None:
        if self.closed:
            return
        error = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            for future in self._pending.values():
                error = error or future.exception()
            self._pending.clear()
        self.k_caches, self.v_caches, self._page_bytes, self._step = [], [], [], None
        self.driver.close()   # refuses (DriverError) while a caller still holds a view of the cache
        self._closed = True
        if error is not None:
            raise error

    def _close_driver_quietly(self) -> None:
        self.k_caches, self.v_caches, self._page_bytes = [], [], []
        try:
            self.driver.close()
        except Exception as exc:  # noqa: BLE001 - the construction error is the one to report
            log.error("vmm: releasing the driver after a failed start-up also failed: %s", exc)
