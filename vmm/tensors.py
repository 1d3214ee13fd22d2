"""The 2L virtual tensors: their reserved address ranges, the tensor views over them, and byte-level copies.

Tensor t (K_0..K_{L-1}, then V_0..V_{L-1}) lives at `place[t] = (region, offset)`: its own reserved range,
or one slice of a single range shared by all (`single_range`). Slot s, page j of tensor t is the page at
offset + s * row_bytes + j * page_size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from kvlab.vmm.driver import Region, VirtualMemory

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVShape
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import Slot


class VirtualTensors:
    def __init__(self, driver: VirtualMemory, geo: Geometry, shape: KVShape, single_range: bool) -> None:
        self.driver, self.geo, self.shape = driver, geo, shape
        if single_range:
            whole = driver.reserve(geo.num_tensors * geo.tensor_bytes)
            self.place: list[tuple[Region, int]] = [(whole, t * geo.tensor_bytes) for t in range(geo.num_tensors)]
        else:
            self.place = [(driver.reserve(geo.tensor_bytes), 0) for _ in range(geo.num_tensors)]
        self.mirror = driver.mirror(self.place, geo.tensor_bytes, geo.num_groups)   # a page group: one map call
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.page_bytes: list[torch.Tensor] = []   # each tensor as raw bytes (copy-on-write copies pages)

    def make_views(self) -> None:
        geo, s = self.geo, self.shape
        dims = (geo.num_slots, geo.max_len, s.num_kv_heads, s.head_dim)
        strides = (geo.row_bytes // s.itemsize, s.num_kv_heads * s.head_dim, s.head_dim, 1)
        views = [self.driver.tensor_view(region, s.torch_dtype, dims, strides, offset)
                 for region, offset in self.place]
        self.k_caches, self.v_caches = views[:s.num_layers], views[s.num_layers:]
        self.page_bytes = [self.driver.tensor_view(region, torch.uint8, (geo.tensor_bytes,), offset=offset)
                           for region, offset in self.place]

    def drop_views(self) -> None:
        """The driver refuses to close while a view is alive."""
        self.k_caches, self.v_caches, self.page_bytes = [], [], []

    def page_offset(self, tensor: int, slot: int, page: int) -> int:
        return self.place[tensor][1] + self.slot_offset(slot, page)

    def slot_offset(self, slot: int, page: int) -> int:
        """Where page `page` of slot `slot` sits inside each tensor."""
        return slot * self.geo.row_bytes + page * self.geo.page_size

    # -- mapping page groups (one call maps or unmaps a run of pages in all 2L tensors) ----------------------
    def map(self, slot: int, page: int, group: int, count: int) -> None:
        """Map groups [group, +count) at pages [page, +count) of the slot in every tensor; all or nothing."""
        self.driver.map_mirrored(self.mirror, self.slot_offset(slot, page), group, count)

    def unmap(self, slot: int, page: int, count: int) -> None:
        """Unmap pages [page, +count) of the slot in every tensor; all or nothing."""
        self.driver.unmap_mirrored(self.mirror, self.slot_offset(slot, page), count)

    def clear(self, slot: int, page: int, count: int) -> None:
        """Unmap whatever is still mapped at pages [page, +count) of the slot in any tensor (torn pages)."""
        self.driver.clear_mirrored(self.mirror, self.slot_offset(slot, page), count)

    def _page_span(self, slot: int, page: int) -> slice:
        start = slot * self.geo.row_bytes + page * self.geo.page_size
        return slice(start, start + self.geo.page_size)

    # -- copies -------------------------------------------------------------------------------------------
    def save_page(self, slot: int, page: int) -> list[torch.Tensor]:
        """The bytes of one page in every tensor (empty without views: accounting mode)."""
        return [b[self._page_span(slot, page)].clone() for b in self.page_bytes]

    def restore_page(self, slot: int, page: int, saved: list[torch.Tensor]) -> None:
        for b, data in zip(self.page_bytes, saved):
            b[self._page_span(slot, page)].copy_(data)

    def copy_out(self, slot: int, tokens: int) -> torch.Tensor:
        """The first `tokens` tokens of a slot in every tensor, on the host: [2L, tokens, H_kv, D]."""
        s = self.shape
        pin = s.device.startswith("cuda") and torch.cuda.is_available()
        data = torch.empty((self.geo.num_tensors, tokens, s.num_kv_heads, s.head_dim), dtype=s.torch_dtype,
                           pin_memory=pin)
        for t, cache in enumerate(self.k_caches + self.v_caches):
            data[t].copy_(cache[slot, :tokens])
        return data

    def copy_in(self, slot: int, data: torch.Tensor) -> None:
        tokens = data.shape[1]
        for t, cache in enumerate(self.k_caches + self.v_caches):
            cache[slot, :tokens].copy_(data[t], non_blocking=True)

    # -- debugging ----------------------------------------------------------------------------------------
    def check_mapped(self, slots: list[Slot]) -> None:
        """Every page the slots claim is mapped by the driver at the right pool page, and no other."""
        total = 0
        for slot in slots:
            for j, g in enumerate(slot.groups):
                for t, (region, _) in enumerate(self.place):
                    va = self.page_offset(t, slot.index, j) // self.geo.page_size
                    assert region.mapped.get(va) == t * self.geo.num_groups + g, \
                        f"slot {slot.index} page {j} tensor {t} is not mapped to group {g}"
            total += len(slot.groups) * self.geo.num_tensors
        assert self.driver.stats.mapped_pages == total, "the driver maps pages no slot accounts for"
