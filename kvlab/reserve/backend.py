"""The pre-2023 baseline (Orca, FasterTransformer): one contiguous KV region per sequence, reserved at
admission. The allocator (regions in a token arena) is in allocator.py, the arena tensors and the kernels'
view in storage.py; `build_reserve` puts them together."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.kv.seam import KVCache, NullStorage
from kvlab.reserve.allocator import ReserveAllocator

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.types import KVShape


def build_reserve(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    books = ReserveAllocator(config, shape)
    if accounting_only:
        return KVCache(allocator=books, storage=NullStorage(), shape=shape)
    from kvlab.reserve.storage import ReserveStorage  # torch: not for the simulator's accounting caches
    return KVCache(allocator=books, storage=ReserveStorage(config, shape, books), shape=shape)
