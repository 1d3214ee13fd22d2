"""The paged storage: one tensor [2, L, num_blocks, block_size, H_kv, D] (per-layer K and V are views), the
step's PagedMetadata built from the allocator's block tables, attention, and the data movements the allocator
orders (copy a block's tokens on write, save blocks for swap-out, restore them on swap-in). Accounting mode has
no storage of its own: the seam's NullStorage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.common.attention.kv_quant import make_quant
from kvlab.common.attention.metadata import BatchItem, PagedMetadata, base_metadata
from kvlab.common.kv.seam import DataStorage
from kvlab.common.kv.types import KVShape
from kvlab.paged.block_pool import BlockPoolError

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.paged.allocator import PagedAllocator


class PagedStorage(DataStorage):
    def __init__(self, config: EngineConfig, shape: KVShape, allocator: PagedAllocator) -> None:
        super().__init__()
        self.shape, self.allocator = shape, allocator      # the allocator's tables say where each token lives
        self.block_size = allocator.block_size
        self.check = config.check_invariants
        self.quant = make_quant(shape, config.kv_cache_scale)   # None: K/V stored in the compute dtype
        # zeros, not empty: padded kernel reads of unused slots must be finite (0 * NaN is NaN);
        # never an inference tensor, so it stays writable whether or not the caller is in inference mode
        with torch.inference_mode(False):
            self.kv: torch.Tensor | None = self.make_pool(shape, allocator.num_total_units())
            self.k_caches: list[torch.Tensor] = list(self.kv[0])
            self.v_caches: list[torch.Tensor] = list(self.kv[1])
        self.build_dispatcher(shape, "paged", config.kernel, block_size=self.block_size)

    def make_pool(self, shape: KVShape, num_blocks: int) -> torch.Tensor:
        """The pool tensor [2, L, num_blocks, block_size, H_kv, D]; a subclass may place it elsewhere (elastic/)."""
        return torch.zeros(2, shape.num_layers, num_blocks, self.block_size, shape.num_kv_heads, shape.head_dim,
                           dtype=shape.cache_dtype, device=shape.device)

    # -- one step -------------------------------------------------------------------------------------
    def prepare(self, items: list[BatchItem]) -> PagedMetadata:
        if self.check:   # the kernel reads every block the tables name: check them first
            self.allocator.check_invariants()
        base = base_metadata(items, self.shape.device)
        rows = [self._table_row(it) for it in items]
        width = max((len(r) for r in rows), default=0)
        padded = [r + [0] * (width - len(r)) for r in rows]
        block_tables = torch.tensor(padded, dtype=torch.int32).reshape(len(items), width).to(self.shape.device)
        slot_mapping = self._slot_mapping(block_tables, base["input_positions"], base["query_lens"])
        return PagedMetadata(**base, block_tables=block_tables, slot_mapping=slot_mapping,
                             block_size=self.block_size)

    def _table_row(self, item: BatchItem) -> list[int]:
        table = self.allocator.block_table(item.seq)
        need = -(-item.context_len // self.block_size)
        if len(table) < need:
            raise BlockPoolError(f"sequence {item.seq.seq_id} holds {len(table)} blocks but this step needs "
                                 f"{need}; call allocate(seq, {item.context_len}) before prepare")
        return [max(b, 0) for b in table[:need]]   # blocks the window dropped (-1): never read, masked; any id

    def _slot_mapping(self, block_tables: torch.Tensor, positions: torch.Tensor,
                      query_lens: torch.Tensor) -> torch.Tensor:
        """block_id * block_size + offset for every new token, with no Python loop over tokens."""
        rows = torch.repeat_interleave(torch.arange(len(query_lens), device=positions.device),
                                       query_lens.to(torch.int64))
        blocks = block_tables[rows, positions // self.block_size].to(torch.int64)
        return blocks * self.block_size + positions % self.block_size

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: PagedMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        if self.check and meta.num_tokens:
            assert int(meta.slot_mapping.max()) < k_cache.shape[0] * self.block_size, "slot outside the pool"
            assert int(meta.block_tables.max()) < k_cache.shape[0], "block table entry outside the pool"
        if self.quant is not None:
            k, v = self.quant.write(layer, k, v)
            self.quant.stamp(meta, layer)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)
        if meta.num_tokens == 0:
            return torch.empty_like(q)
        return self.dispatcher.run(meta.phase, q, k_cache, v_cache, meta, scale)

    # -- the data movements the allocator orders (addresses are block ids) ----------------------------------
    def copy(self, src: int, dst: int, num_tokens: int) -> None:
        self.kv[:, :, dst, :num_tokens].copy_(self.kv[:, :, src, :num_tokens])   # every layer, K and V, at once

    def save(self, blocks: list[int], num_tokens: int) -> torch.Tensor | None:
        """The blocks' K/V of every layer, [2, L, len(blocks), block_size, H_kv, D], copied to the CPU."""
        if not blocks:
            return None
        ids = torch.tensor(blocks, dtype=torch.int64, device=self.kv.device)
        return self.kv.index_select(2, ids).to("cpu")

    def restore(self, blocks: list[int], num_tokens: int, host: torch.Tensor | None) -> None:
        """Write what `save` returned into `blocks` (new ids, same order)."""
        if host is None:
            return
        ids = torch.tensor(blocks, dtype=torch.int64, device=self.kv.device)
        self.kv.index_copy_(2, ids, host.to(self.kv.device))

    def close(self) -> None:
        super().close()
        self.kv = None
        self.k_caches, self.v_caches = [], []

