"""The reserve baseline's storage: per layer one K and one V arena `[rows, H_kv, D]`, and the contiguous view
the kernels read.

The kernels get a view `[num_rows, max_len, H_kv, D]` with `ContiguousMetadata.slots` = row ids:
- "max": regions start at multiples of max_len, the view is the plain reshape `[num_slots, max_len, ...]`
  and a region's slot is start // max_len;
- "oracle": regions start anywhere, so the view is an overlapping `as_strided` one whose row r begins at
  token r (row stride = one token) and a region's slot is its start token. Kernels read only
  `[slot, :context_len]`, which lies inside the region. The arena carries max_len - 1 padding tokens past the
  budget so the last rows of the view stay inside the storage (reported as extra["padding_tokens"]; the
  padding is never allocated to a sequence and is not part of the capacity).
This backend writes the step's K/V itself (one index_copy_ per layer through `write_index`) before the kernel.
The allocator's orders arrive through `move` (DataStorage): addresses are start tokens in the arena.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlab.common.attention.kv_quant import make_quant
from kvlab.common.attention.metadata import AttentionMetadata, BatchItem, ContiguousMetadata, base_metadata
from kvlab.common.kv.seam import DataStorage

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.types import CacheStats, KVShape
    from kvlab.reserve.allocator import ReserveAllocator


@dataclass(slots=True)
class ReserveMetadata(ContiguousMetadata):
    write_index: torch.Tensor = None       # int64 [T]: arena row of each of this step's tokens


class ReserveStorage(DataStorage):
    def __init__(self, config: EngineConfig, shape: KVShape, books: ReserveAllocator) -> None:
        super().__init__()
        self.shape, self.books, self.check = shape, books, config.check_invariants
        self.quant = make_quant(shape, config.kv_cache_scale)   # None: K/V stored in the compute dtype
        self.padding_tokens = 0 if books.mode == "max" else books.max_len - 1
        rows = books.capacity + self.padding_tokens
        self.k = [self._arena(rows) for _ in range(shape.num_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.k_rows = [self._rows(t) for t in self.k]
        self.v_rows = [self._rows(t) for t in self.v]
        self.build_dispatcher(shape, "contiguous", config.kernel)

    def _arena(self, rows: int) -> torch.Tensor:
        s = self.shape
        return torch.zeros((max(rows, 1), s.num_kv_heads, s.head_dim), dtype=s.cache_dtype, device=s.device)

    def _rows(self, arena: torch.Tensor) -> torch.Tensor:
        """The kernels' [num_rows, max_len, H_kv, D] view of one arena (overlapping rows in oracle mode)."""
        s, b = self.shape, self.books
        num_rows = b.capacity // b.row_stride
        if not num_rows:
            return arena[:0].view(0, b.max_len, *arena.shape[1:])
        hd = s.num_kv_heads * s.head_dim
        return arena.as_strided((num_rows, b.max_len, s.num_kv_heads, s.head_dim),
                                (b.row_stride * hd, hd, s.head_dim, 1))

    def add_to_stats(self, stats: CacheStats) -> None:
        """The padding rows are backed too (never allocated, not part of the capacity)."""
        stats.extra["padding_tokens"] = self.padding_tokens
        stats.reserved_bytes += self.padding_tokens * self.shape.bytes_per_token
        stats.mapped_bytes += self.padding_tokens * self.shape.bytes_per_token

    # -- the data movements the allocator orders ----------------------------------------------------------------
    def copy(self, src: int, dst: int, n: int) -> None:
        for t in (*self.k, *self.v):
            t[dst:dst + n].copy_(t[src:src + n])

    def save(self, start: int, n: int) -> torch.Tensor:
        s = self.shape
        pin = torch.device(s.device).type == "cuda"
        host = torch.empty((2, s.num_layers, n, s.num_kv_heads, s.head_dim), dtype=s.cache_dtype, pin_memory=pin)
        for layer in range(s.num_layers):
            host[0, layer].copy_(self.k[layer][start:start + n])
            host[1, layer].copy_(self.v[layer][start:start + n])
        return host

    def restore(self, start: int, n: int, host: torch.Tensor) -> None:
        for layer in range(self.shape.num_layers):
            self.k[layer][start:start + n].copy_(host[0, layer])
            self.v[layer][start:start + n].copy_(host[1, layer])

    # -- one step ---------------------------------------------------------------------------------------------
    def prepare(self, items: list[BatchItem]) -> AttentionMetadata:
        device = self.shape.device
        kw = base_metadata(items, device=device)
        book = self.books.regions
        regions = [book.spans[it.seq.seq_id] for it in items]
        if self.check:
            for it in items:
                assert it.context_len <= book.held[it.seq.seq_id], f"sequence {it.seq.seq_id} not allocated"
        start_t = torch.tensor([start for start, _ in regions], dtype=torch.int64, device=device)
        write_index = kw["input_positions"] + start_t.repeat_interleave(kw["query_lens"].long())
        readable = torch.tensor([min(size, self.books.max_len) for _, size in regions],
                                dtype=torch.int64, device=device)   # a row is readable to its region's end
        return ReserveMetadata(**kw, slots=start_t // self.books.row_stride, readable_lens=readable,
                               write_index=write_index)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.quant is not None:
            k, v = self.quant.write(layer, k, v)
            self.quant.stamp(meta, layer)
        self.k[layer].index_copy_(0, meta.write_index, k)
        self.v[layer].index_copy_(0, meta.write_index, v)
        return self.dispatcher.run(meta.phase, q, self.k_rows[layer], self.v_rows[layer], meta, scale)

    def close(self) -> None:
        super().close()
        self.k, self.v = [], []
        self.k_rows, self.v_rows = [], []

