"""The vmm storage (the runner's and model's side): K/V are contiguous views over the allocator's reserved ranges
(vmm/views.py), so a step's metadata names each sequence's slot (its row) and readable length, and attention is
the contiguous kernels picked once by the dispatcher. It owns the views and the host copies of swapped-out
sequences, and carries out the data movements the allocator orders (`move`): a page copied for copy-on-write,
a sequence saved, restored or dropped for swap. Addresses are (slot, page) for a copy, (slot, first token) else."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.common.attention.kv_quant import make_quant
from kvlab.common.attention.metadata import ContiguousMetadata, base_metadata
from kvlab.common.kv.seam import Storage
from kvlab.common.kv.types import CopyKV, DropSavedKV, KVMove, KVShape, RestoreKV, SaveKV

if TYPE_CHECKING:
    from kvlab.common.attention.metadata import BatchItem
    from kvlab.vmm.allocator import VMMAllocator
    from kvlab.vmm.views import KVViews


class VMMStorage(Storage):
    def __init__(self, allocator: VMMAllocator, views: KVViews, shape: KVShape, kernel: str, check: bool,
                 kv_scale: float = 0.0) -> None:
        self.allocator, self.views, self.shape, self.check = allocator, views, shape, check
        self.quant = make_quant(shape, kv_scale)   # None: K/V stored in the compute dtype
        self._step: tuple[ContiguousMetadata, torch.Tensor] | None = None   # this step's metadata, token slots
        self.saved: dict[int, torch.Tensor] = {}   # seq_id -> [2L, tokens, H_kv, D] on the host (swapped out)
        self._moves = {CopyKV: self._copy, SaveKV: self._save, RestoreKV: self._restore, DropSavedKV: self._drop}
        self.build_dispatcher(shape, "contiguous", kernel)

    @property
    def k_caches(self) -> list[torch.Tensor]:
        """K per layer, [num_slots, max_len, H_kv, D] (benchmarks write contexts straight into them)."""
        return self.views.k

    @property
    def v_caches(self) -> list[torch.Tensor]:
        return self.views.v

    def prepare(self, items: list[BatchItem]) -> ContiguousMetadata:
        slots, readable = self.allocator.rows(items, check=self.check)
        device = self.shape.device
        meta = ContiguousMetadata(**base_metadata(items, device),
                                  slots=torch.tensor(slots, dtype=torch.int64, device=device),
                                  readable_lens=torch.tensor(readable, dtype=torch.int64, device=device))
        self._step = (meta, meta.slots.repeat_interleave(meta.query_lens.to(torch.int64)))
        return meta

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: ContiguousMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.views.k[layer], self.views.v[layer]
        if self._step is not None and self._step[0] is meta:
            token_slots = self._step[1]
        else:
            token_slots = meta.slots.repeat_interleave(meta.query_lens.to(torch.int64))
        index = (token_slots, meta.input_positions)
        if self.quant is not None:
            k, v = self.quant.write(layer, k, v)
            self.quant.stamp(meta, layer)
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
        if self.check:   # the books still back every position the kernel reads
            self.allocator.rows(meta.items, check=True)
        return self.dispatcher.run(meta.phase, q, k_cache, v_cache, meta, scale)

    def move(self, order: KVMove) -> None:
        """Carry out the allocator's order now (it may unmap the pages a save reads right after)."""
        self._moves[type(order)](order)

    def _copy(self, order: CopyKV) -> None:
        self.views.copy_page(order.src, order.dst)

    def _save(self, order: SaveKV) -> None:
        slot, start = order.where
        self.saved[order.seq_id] = self.views.copy_out(slot, start, order.num_tokens)

    def _restore(self, order: RestoreKV) -> None:
        slot, start = order.where
        self.views.copy_in(slot, start, self.saved.pop(order.seq_id))

    def _drop(self, order: DropSavedKV) -> None:
        self.saved.pop(order.seq_id, None)

    def close(self) -> None:
        """Drop this step's tensors, the host copies and the views (the allocator's driver refuses to close while
        one lives)."""
        self._step = None
        self.saved.clear()
        self.views.drop()
