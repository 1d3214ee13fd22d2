"""The pre-2023 baseline (Orca, FasterTransformer): one contiguous KV region per sequence, at admission.

Each sequence gets a region of `max_model_len` tokens (reserve_mode "max") or exactly its final length
(`prompt + max_tokens`, reserve_mode "oracle"), first-fit in one flat arena of
kv_cache_bytes // bytes_per_token token slots; freeing merges free neighbours, so differently sized oracle
regions leave real external fragmentation. No sharing: fork copies the parent's region (the baseline's
point); swap copies a region to host memory and back (into whatever region is free then). Units are tokens.

Real mode keeps per layer one K and one V arena `[rows, H_kv, D]` and hands the contiguous kernels a view
`[num_rows, max_len, H_kv, D]` with `ContiguousMetadata.slots` = row ids:
- "max": regions start at multiples of max_len, the view is the plain reshape `[num_slots, max_len, ...]`
  and a region's slot is start // max_len;
- "oracle": regions start anywhere, so the view is an overlapping `as_strided` one whose row r begins at
  token r (row stride = one token) and a region's slot is its start token. Kernels read only
  `[slot, :context_len]`, which lies inside the region. The arena carries max_len - 1 padding tokens past the
  budget so the last rows of the view stay inside the storage (reported as extra["padding_tokens"]; the
  padding is never allocated to a sequence and is not part of the capacity).
This backend writes the step's K/V itself (one index_copy_ per layer through `write_index`) before the kernel.
"""
from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from kvlab.common.arena import Arena
from kvlab.common.attention.metadata import AttentionMetadata, BatchItem, ContiguousMetadata, base_metadata
from kvlab.common.errors import OutOfKVCache
from kvlab.common.kv.seam import Allocator, CacheStats, KVCache, KVShape, Storage

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence


@dataclass(slots=True)
class ReserveMetadata(ContiguousMetadata):
    write_index: torch.Tensor = None       # int64 [T]: arena row of each of this step's tokens


class ReserveKVCache(Allocator, Storage):
    name = "reserve"
    unit_name = "token"
    tokens_per_unit = 1

    def __init__(self, config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> None:
        self.config, self.shape, self.accounting_only = config, shape, accounting_only
        self.mode = config.options_of("reserve").reserve_mode
        self.max_len = config.max_model_len
        self.bytes_per_token = shape.bytes_per_token
        budget = config.kv_cache_bytes // self.bytes_per_token
        self.row_stride = self.max_len if self.mode == "max" else 1
        self.capacity = (budget // self.max_len) * self.max_len if self.mode == "max" else budget
        self.padding_tokens = 0 if self.mode == "max" or accounting_only else self.max_len - 1
        self.arena = Arena(self.capacity)
        self.regions: dict[int, tuple[int, int]] = {}      # seq_id -> (start, size)
        self.held: dict[int, int] = {}                     # seq_id -> tokens stored
        self.final: dict[int, int] = {}                    # seq_id -> min(size, final_len)
        self.swap_store: dict[int, tuple[int, torch.Tensor | None]] = {}
        self.live = self.allocated = self.will_use = 0
        self.swapped_out_bytes = self.swapped_in_bytes = self.fork_copy_tokens = 0
        self.allocator_seconds = 0.0
        self.dispatcher = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        if not accounting_only:
            self._allocate_tensors()

    # -- memory ---------------------------------------------------------------------------------------------
    def _allocate_tensors(self) -> None:
        from kvlab.common.attention.dispatch import AttentionSpec
        from kvlab.common.attention.dispatch import make_dispatcher
        s = self.shape
        rows = self.capacity + self.padding_tokens
        num_rows = self.capacity // self.row_stride
        hd = s.num_kv_heads * s.head_dim
        view = ((num_rows, self.max_len, s.num_kv_heads, s.head_dim),
                (self.row_stride * hd, hd, s.head_dim, 1))
        for _ in range(s.num_layers):
            k = torch.zeros((max(rows, 1), s.num_kv_heads, s.head_dim), dtype=s.torch_dtype, device=s.device)
            v = torch.zeros_like(k)
            self.k.append(k)
            self.v.append(v)
        self.k_rows = [t.as_strided(*view) if num_rows else t[:0].view(0, self.max_len, *t.shape[1:])
                       for t in self.k]
        self.v_rows = [t.as_strided(*view) if num_rows else t[:0].view(0, self.max_len, *t.shape[1:])
                       for t in self.v]
        device = torch.device(s.device)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        spec = AttentionSpec(layout="contiguous", device=device.type, dtype=s.dtype, head_dim=s.head_dim,
                             num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
                             compute_capability=capability)
        self.dispatcher = make_dispatcher(spec, self.config.kernel)

    def _region_size(self, seq: Sequence, num_tokens: int) -> int:
        return self.max_len if self.mode == "max" else max(seq.final_len, num_tokens)

    def _claim(self, seq: Sequence, num_tokens: int, what: str) -> int:
        size = self._region_size(seq, num_tokens)
        start = self.arena.take(size)
        if start is None:
            raise OutOfKVCache(f"reserve cache: no contiguous free region of {size} tokens for {what} of "
                               f"sequence {seq.seq_id} (free {self.arena.free_total}, largest extent "
                               f"{self.arena.largest})")
        self.regions[seq.seq_id] = (start, size)
        self.held[seq.seq_id] = 0
        self.final[seq.seq_id] = min(size, seq.final_len)
        self.allocated += size
        self.will_use += self.final[seq.seq_id]
        return start

    def _release(self, seq_id: int) -> None:
        start, size = self.regions.pop(seq_id)
        self.arena.give(start, size)
        self.live -= self.held.pop(seq_id)
        self.will_use -= self.final.pop(seq_id)
        self.allocated -= size

    def _set_held(self, seq_id: int, num_tokens: int) -> None:
        self.live += num_tokens - self.held[seq_id]
        self.held[seq_id] = num_tokens

    def _copy(self, src: int, dst: int, n: int) -> None:
        for t in (*self.k, *self.v):
            t[dst:dst + n].copy_(t[src:src + n])

    # -- capacity -------------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.capacity

    def num_free_units(self) -> int:
        return self.arena.free_total

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        region = self.regions.get(seq.seq_id)
        if region is not None:
            return max(0, num_tokens - region[1])      # > 0 means it can never grow there
        return self._region_size(seq, num_tokens)

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> bool:
        region = self.regions.get(seq.seq_id)
        if region is not None:
            return num_tokens <= region[1]
        size = self._region_size(seq, num_tokens)
        return size + reserve_units <= self.arena.free_total and self.arena.find(size) is not None

    def max_tokens_per_seq(self) -> int:
        if self.mode == "max":
            return self.max_len if self.capacity >= self.max_len else 0
        return self.capacity

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _take(self, seq: Sequence, num_tokens: int) -> int:
        t0 = time.perf_counter()
        region = self.regions.get(seq.seq_id)
        if region is None:
            self._claim(seq, num_tokens, "admission")
        elif num_tokens > region[1]:
            raise OutOfKVCache(f"reserve cache: sequence {seq.seq_id} reserved {region[1]} tokens and cannot "
                               f"grow to {num_tokens}")
        if num_tokens > self.held[seq.seq_id]:
            self._set_held(seq.seq_id, num_tokens)
        self.allocator_seconds += time.perf_counter() - t0
        return 0

    def free(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        if seq.seq_id in self.regions:
            self._release(seq.seq_id)
        self.swap_store.pop(seq.seq_id, None)
        self.allocator_seconds += time.perf_counter() - t0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """No sharing in the baseline: the child gets its own region and a copy of the parent's tokens."""
        t0 = time.perf_counter()
        n = self.held[parent.seq_id]
        start = self._claim(child, n, "fork")
        self._set_held(child.seq_id, n)
        if not self.accounting_only:
            self._copy(self.regions[parent.seq_id][0], start, n)
        self.fork_copy_tokens += n
        self.allocator_seconds += time.perf_counter() - t0

    def swap_out(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        start, _ = self.regions[seq.seq_id]
        n = self.held[seq.seq_id]
        host = None
        if not self.accounting_only:
            pin = torch.device(self.shape.device).type == "cuda"
            host = torch.empty((2, self.shape.num_layers, n, self.shape.num_kv_heads, self.shape.head_dim),
                               dtype=self.shape.torch_dtype, pin_memory=pin)
            for layer in range(self.shape.num_layers):
                host[0, layer].copy_(self.k[layer][start:start + n])
                host[1, layer].copy_(self.v[layer][start:start + n])
        self._release(seq.seq_id)
        self.swap_store[seq.seq_id] = (n, host)
        self.swapped_out_bytes += n * self.bytes_per_token
        self.allocator_seconds += time.perf_counter() - t0

    def _swap_in(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        n, host = self.swap_store[seq.seq_id]
        start = self._claim(seq, n, "swap-in")          # raises before the host copy is dropped
        del self.swap_store[seq.seq_id]
        self._set_held(seq.seq_id, n)
        if host is not None:
            for layer in range(self.shape.num_layers):
                self.k[layer][start:start + n].copy_(host[0, layer])
                self.v[layer][start:start + n].copy_(host[1, layer])
        self.swapped_in_bytes += n * self.bytes_per_token
        self.allocator_seconds += time.perf_counter() - t0

    def can_swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        return self.can_allocate(seq, self.swap_store[seq.seq_id][0], reserve_units)

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.regions

    # -- one step -------------------------------------------------------------------------------------------
    def prepare(self, items: list[BatchItem]) -> AttentionMetadata:
        device = self.shape.device
        kw = base_metadata(items, device=device)
        starts = [self.regions[it.seq.seq_id][0] for it in items]
        if self.config.check_invariants:
            for it in items:
                assert it.context_len <= self.held[it.seq.seq_id], f"sequence {it.seq.seq_id} not allocated"
        start_t = torch.tensor(starts, dtype=torch.int64, device=device)
        write_index = kw["input_positions"] + start_t.repeat_interleave(kw["query_lens"].long())
        readable = torch.tensor([min(self.regions[it.seq.seq_id][1], self.max_len) for it in items],
                                dtype=torch.int64, device=device)   # a row is readable to its region's end
        return ReserveMetadata(**kw, slots=start_t // self.row_stride, readable_lens=readable,
                               write_index=write_index)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.k[layer].index_copy_(0, meta.write_index, k)
        self.v[layer].index_copy_(0, meta.write_index, v)
        return self.dispatcher.run(meta.phase, q, self.k_rows[layer], self.v_rows[layer], meta, scale)

    # -- observability --------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        free = self.arena.free_total
        backed = (self.capacity + self.padding_tokens) * self.bytes_per_token
        return CacheStats(
            backend=self.name, unit_name=self.unit_name, tokens_per_unit=1, total_units=self.capacity,
            used_units=self.capacity - free, free_units=free, live_tokens=self.live,
            allocated_token_slots=self.allocated, reserved_bytes=backed, mapped_bytes=backed,
            swapped_out_bytes=self.swapped_out_bytes, swapped_in_bytes=self.swapped_in_bytes,
            allocator_seconds=self.allocator_seconds,
            extra={
                "reserve_mode": self.mode,
                "reserved_waste_tokens": self.will_use - self.live,
                "never_used_tokens": self.allocated - self.will_use,
                "num_regions": len(self.regions),
                "free_extents": len(self.arena.starts),
                "largest_free_extent": self.arena.largest,
                "external_fragmentation": 1 - self.arena.largest / free if free else 0.0,
                "fork_copy_tokens": self.fork_copy_tokens,
                "swapped_sequences": len(self.swap_store),
                "padding_tokens": self.padding_tokens,
            })

    def kernel_report(self) -> dict[str, Any]:
        return self.dispatcher.report() if self.dispatcher is not None else {}

    def check_invariants(self) -> None:
        self.arena.check()
        spans = sorted(self.regions.values())
        for (a, sa), (b, _) in itertools.pairwise(spans):
            assert a + sa <= b, "regions overlap"
        for start, size in spans:
            i = bisect.bisect_right(self.arena.starts, start) - 1
            below = i < 0 or self.arena.starts[i] + self.arena.lengths[i] <= start
            assert below, "a region overlaps free space"
            assert start + size <= self.capacity
            assert self.mode == "oracle" or start % self.max_len == 0
        assert self.arena.free_total + sum(s for _, s in spans) == self.capacity, "tokens leaked"
        assert self.live == sum(self.held.values())
        assert self.allocated == sum(s for _, s in spans)
        assert all(self.held[sid] <= self.regions[sid][1] for sid in self.regions)

    def close(self) -> None:
        self.k, self.v = [], []
        self.k_rows, self.v_rows = [], []

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

    def snapshot(self) -> dict:
        return {}


def build_reserve(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    cache = ReserveKVCache(config, shape, accounting_only)
    return KVCache(allocator=cache, storage=cache, shape=shape)
