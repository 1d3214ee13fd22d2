"""The elastic storage: paged's storage (metadata from the block tables, attention through the paged kernels, the
copy/save/restore orders) over a zero-copy view of the allocator's reserved planes instead of a tensor of its own."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.common.kv.types import KVShape
from kvlab.paged.storage import PagedStorage

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.elastic.allocator import ElasticAllocator


class ElasticStorage(PagedStorage):
    def __init__(self, config: EngineConfig, shape: KVShape, allocator: ElasticAllocator) -> None:
        self.memory, self.geo = allocator.memory, allocator.geo
        super().__init__(config, shape, allocator)

    def make_pool(self, shape: KVShape, num_blocks: int) -> torch.Tensor:
        dims = (2, shape.num_layers, num_blocks, self.block_size, shape.num_kv_heads, shape.head_dim)
        return self.memory.tensor(shape.cache_dtype, dims, self.geo.strides(self.block_size, shape))
