"""PagedAttention as the engine sees it: a PagedAllocator (block tables, no tensors) and its storage."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.kv.seam import KVCache, NullStorage
from kvlab.common.kv.types import KVShape
from kvlab.paged.allocator import PagedAllocator

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig


def build_paged(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    """A real storage reads the allocator's tables; the cache hands it the allocator's orders. Accounting mode
    has the null storage, which discards them."""
    allocator = PagedAllocator(config, shape)
    if accounting_only:
        return KVCache(allocator=allocator, storage=NullStorage(), shape=shape)
    from kvlab.paged.storage import PagedStorage  # torch: not for the simulator's accounting caches
    return KVCache(allocator=allocator, storage=PagedStorage(config, shape, allocator), shape=shape)
