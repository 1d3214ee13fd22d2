"""PagedAttention as the engine sees it: a PagedAllocator (block tables, no tensors) and its storage."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.kv.seam import KVCache
from kvlab.common.kv.types import KVShape
from kvlab.paged.allocator import PagedAllocator
from kvlab.paged.storage import PagedStorage

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig


def build_paged(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    """The allocator alone issues its data operations to a NullPagedStorage (accounting mode); a real
    storage reads the allocator's tables and becomes where those operations go."""
    allocator = PagedAllocator(config, shape)
    if not accounting_only:
        allocator.storage = PagedStorage(config, shape, allocator)
    return KVCache(allocator=allocator, storage=allocator.storage, shape=shape)
