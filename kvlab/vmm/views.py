"""The 2L virtual tensors (K_0..K_{L-1}, then V_0..V_{L-1}): their reserved address ranges (`Ranges`, the
allocator's), and the K/V views over them (`KVViews`, the storage's; an accounting-only cache has none).

Tensor t lives at `places[t] = (region, offset)`: its own reserved range, or one slice of a single range shared
by all (`single_range`). Slot s, page j of tensor t is the page at offset + s * row_bytes + j * page_size. The
views are built before any page is mapped and never read memory (vmm/drivers/dlpack.py on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvlab.common.kv.types import KVShape
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.drivers.types import Mirror, Region
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import Slot


@dataclass(slots=True)
class Ranges:
    """Where the 2L tensors live, and the mirror that maps a page group in all of them with one call."""
    places: list[tuple[Region, int]]
    mirror: Mirror

    @classmethod
    def reserve(cls, driver: VirtualMemory, geo: Geometry, single_range: bool) -> Ranges:
        if single_range:
            whole = driver.reserve(geo.num_tensors * geo.tensor_bytes)
            places = [(whole, t * geo.tensor_bytes) for t in range(geo.num_tensors)]
        else:
            places = [(driver.reserve(geo.tensor_bytes), 0) for _ in range(geo.num_tensors)]
        return cls(places, driver.mirror(places, geo.tensor_bytes, geo.num_groups))

    def check_mapped(self, driver: VirtualMemory, geo: Geometry, slots: list[Slot]) -> None:
        """Every page the slots claim is mapped by the driver at the right store page, and no other."""
        total = 0
        for slot in slots:
            for j, g in enumerate(slot.groups[slot.dropped:], slot.dropped):
                for t, (region, offset) in enumerate(self.places):
                    va = (offset + slot.index * geo.row_bytes + j * geo.page_size) // geo.page_size
                    assert region.mapped.get(va) == t * geo.num_groups + g, \
                        f"slot {slot.index} page {j} tensor {t} is not mapped to group {g}"
            total += (len(slot.groups) - slot.dropped) * geo.num_tensors
        assert driver.stats.mapped_pages == total, "the driver maps pages no slot accounts for"


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
