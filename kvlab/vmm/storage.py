"""The vmm storage (the runner's and model's side): K/V are contiguous views over the allocator's reserved ranges
(`KVViews`, built before any page is mapped, never reading memory: vmm/drivers/dlpack.py on CUDA), so a step's
metadata names each sequence's slot (its row) and readable length, and attention is the contiguous kernels picked
once by the dispatcher. It owns the views; the seam's `DataStorage` keeps the host copies of swapped-out sequences
and carries out the allocator's orders (`move`) with this storage's `copy` (a page copied for copy-on-write), `save`
and `restore` (swap). Addresses are (slot, page) for a copy, (slot, first token) else."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.common.attention.kv_quant import make_quant
from kvlab.common.attention.metadata import ContiguousMetadata, base_metadata
from kvlab.common.kv.seam import DataStorage
from kvlab.common.kv.types import KVShape

if TYPE_CHECKING:
    from kvlab.common.attention.metadata import BatchItem
    from kvlab.vmm.allocator import VMMAllocator
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import Ranges


class VMMStorage(DataStorage):
    def __init__(self, allocator: VMMAllocator, views: KVViews, shape: KVShape, kernel: str, check: bool,
                 kv_scale: float = 0.0) -> None:
        super().__init__()
        self.allocator, self.views, self.shape, self.check = allocator, views, shape, check
        self.quant = make_quant(shape, kv_scale)   # None: K/V stored in the compute dtype
        self._step: tuple[ContiguousMetadata, torch.Tensor] | None = None   # this step's metadata, token slots
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

    def copy(self, src: tuple[int, int], dst: tuple[int, int], num_tokens: int) -> None:
        """A whole page's bytes (tokens may straddle pages)."""
        self.views.copy_page(src, dst)

    def save(self, where: tuple[int, int], num_tokens: int) -> torch.Tensor:
        """[2L, num_tokens, H_kv, D] on the host."""
        slot, start = where
        return self.views.copy_out(slot, start, num_tokens)

    def restore(self, where: tuple[int, int], num_tokens: int, host: torch.Tensor) -> None:
        slot, start = where
        self.views.copy_in(slot, start, host)

    def close(self) -> None:
        """Drop this step's tensors, the host copies and the views (the allocator's driver refuses to close while
        one lives)."""
        self._step = None
        super().close()
        self.views.drop()


class KVViews:
    """Zero-copy views over the ranges: `k[layer]`, `v[layer]` [num_slots, max_len, H_kv, D], and each tensor as
    raw bytes (copy-on-write copies pages). The storage's: it carries out the allocator's data movements on them."""

    def __init__(self, driver: VirtualMemory, geo: Geometry, shape: KVShape, ranges: Ranges) -> None:
        self.geo, self.shape = geo, shape
        dims = (geo.num_slots, geo.max_len, shape.num_kv_heads, shape.head_dim)
        strides = (geo.row_bytes // shape.itemsize, shape.num_kv_heads * shape.head_dim, shape.head_dim, 1)
        views = [driver.tensor_view(region, shape.cache_dtype, dims, strides, offset)
                 for region, offset in ranges.places]
        self.k, self.v = views[:shape.num_layers], views[shape.num_layers:]
        self.page_bytes = [driver.tensor_view(region, torch.uint8, (geo.tensor_bytes,), offset=offset)
                           for region, offset in ranges.places]

    def drop(self) -> None:
        """The driver refuses to close while a view is alive."""
        self.k, self.v, self.page_bytes = [], [], []

    def _page_span(self, slot: int, page: int) -> slice:
        start = slot * self.geo.row_bytes + page * self.geo.page_size
        return slice(start, start + self.geo.page_size)

    def copy_page(self, src: tuple[int, int], dst: tuple[int, int]) -> None:
        """The bytes of page src = (slot, page) in every tensor, written at dst (copy-on-write: a page's bytes, not
        its tokens, since tokens may straddle pages)."""
        for b in self.page_bytes:
            b[self._page_span(*dst)].copy_(b[self._page_span(*src)])

    def copy_out(self, slot: int, start: int, num_tokens: int) -> torch.Tensor:
        """Tokens [start, start + num_tokens) of a slot in every tensor, on the host: [2L, num_tokens, H_kv, D] (a
        sliding window's slot has nothing mapped below `start`)."""
        s = self.shape
        pin = s.device.startswith("cuda") and torch.cuda.is_available()
        data = torch.empty((self.geo.num_tensors, num_tokens, s.num_kv_heads, s.head_dim), dtype=s.cache_dtype,
                           pin_memory=pin)
        for t, cache in enumerate(self.k + self.v):
            data[t].copy_(cache[slot, start:start + num_tokens])
        return data

    def copy_in(self, slot: int, start: int, data: torch.Tensor) -> None:
        end = start + data.shape[1]
        for t, cache in enumerate(self.k + self.v):
            cache[slot, start:end].copy_(data[t], non_blocking=True)
