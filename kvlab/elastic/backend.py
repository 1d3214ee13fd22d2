"""Building an elastic cache: the accounting mode (the simulator) is the accounting driver and the null storage."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.kv.seam import KVCache, NullStorage
from kvlab.common.kv.types import KVShape
from kvlab.elastic.allocator import ElasticAllocator
from kvlab.elastic.storage import ElasticStorage

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig


def build_elastic(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    allocator = ElasticAllocator(config, shape, accounting_only)
    if accounting_only:
        return KVCache(allocator=allocator, storage=NullStorage(), shape=shape)
    try:
        storage = ElasticStorage(config, shape, allocator)
    except BaseException:
        allocator.close()
        raise
    return KVCache(allocator=allocator, storage=storage, shape=shape)
