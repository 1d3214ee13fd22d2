"""Building a vmm cache: the one place that tells the accounting mode (the simulator) from a real one. Accounting
is the accounting driver (no memory) and the seam's `NullStorage` (no views, the allocator's orders discarded); the
classes never ask which."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.kv.seam import KVCache, NullStorage
from kvlab.common.kv.types import KVShape
from kvlab.vmm.allocator import VMMAllocator
from kvlab.vmm.drivers.factory import make_driver

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.vmm.drivers.base import VirtualMemory


def build_vmm(config: EngineConfig, shape: KVShape, accounting_only: bool = False,
              driver: VirtualMemory | None = None, single_range: bool | None = None) -> KVCache:
    """`driver`: one already made (tests: a failing or a fake-backed one); else the device's, or the accounting
    driver when `accounting_only`."""
    opts = config.options_of("vmm")
    driver = driver or make_driver(shape.device, opts.page_size, accounting_only, config.kv_pool,
                                   config.kv_pool_bytes)
    allocator = VMMAllocator(config, shape, driver, single_range)
    if accounting_only:
        return KVCache(allocator=allocator, storage=NullStorage(), shape=shape)
    from kvlab.vmm.storage import KVViews, VMMStorage  # torch: not for the simulator's accounting caches
    try:
        views = KVViews(allocator.driver, allocator.geo, shape, allocator.ranges)
        storage = VMMStorage(allocator, views, shape, config.kernel, config.check_invariants, config.kv_cache_scale)
    except BaseException:
        allocator.close()
        raise
    return KVCache(allocator=allocator, storage=storage, shape=shape)
