"""The elastic allocator: paged's allocator (block tables, reference counts, copy-on-write, prefix caching, swap)
over an `ElasticBlockPool`, whose chunks of virtual memory are mapped when a block in them is first needed and
unmapped when none is held. Bookkeeping and the mapping calls only; the storage reads the same memory through a
view (elastic/storage.py)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvlab.common.kv.types import CacheStats, KVShape
from kvlab.elastic.block_pool import ElasticBlockPool
from kvlab.elastic.chunks import ChunkBooks
from kvlab.elastic.geometry import ChunkGeometry
from kvlab.elastic.memory import ElasticMemory, driver_page_size, open_driver
from kvlab.paged.allocator import PagedAllocator
from kvlab.vmm.drivers.machine_pool import NO_POOL
from kvlab.vmm.drivers.map_budget import MapBudgetExhausted

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.drivers.base import VirtualMemory

log = logging.getLogger("kvlab.elastic")


class ElasticAllocator(PagedAllocator):
    name = "elastic"

    def __init__(self, config: EngineConfig, shape: KVShape, accounting_only: bool = False,
                 driver: VirtualMemory | None = None) -> None:
        """`driver`: the caller's (the simulated shared pool's); else the device's."""
        opts = config.options_of("elastic")
        super().__init__(config.replace(block_size=opts.elastic_block_size), shape)
        if driver is None:
            driver = open_driver(shape.device, opts.elastic_page_size, accounting_only)
        try:
            self.geo = ChunkGeometry.of(shape, self.block_size, driver_page_size(driver), config.kv_cache_bytes)
        except BaseException:
            driver.close()
            raise
        self.memory = ElasticMemory(driver, self.geo)
        self.driver = driver     # its counters price the map calls in `kvlab simulate serve` (sim/serve/tap.py)
        books = ChunkBooks(self.geo, self.memory.map_chunk, self.memory.unmap_chunk)
        cap = None if opts.elastic_cached_blocks < 0 else opts.elastic_cached_blocks
        # the same number of blocks as the pool paged built, its memory mapped chunk by chunk
        self.pool = ElasticBlockPool(self.geo.num_blocks, self.prefix_cache, books, opts.elastic_placement, cap)
        # a machine-wide pool (vmm/drivers/machine_pool.py): hold its pages before a growth maps, answer its asks
        self.machine_pool = driver.pool
        self.pool_refusals = 0
        driver.pool.answer_asks(self.give_back, self.pool.givable_pages)

    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        if self.machine_pool is not NO_POOL and not self._hold_pages(seq, num_tokens, reserve_units):
            return None
        return super().allocate(seq, num_tokens, reserve_units)

    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        if (self.machine_pool is not NO_POOL and seq.seq_id in self.swapped
                and not self._hold_pages(seq, seq.num_computed_tokens, reserve_units)):
            return False
        return super().swap_in(seq, reserve_units)

    def _hold_pages(self, seq: Sequence, num_tokens: int, reserve_units: int) -> bool:
        """Make sure the maps the allocation may make cannot be refused halfway (paged's allocate is not undone):
        hold their pages in the pool first; refused, give back this engine's own cached chunks and try once more.
        Still refused: False (out of room, like out of KV), logged and counted."""
        blocks = self.units_needed(seq, num_tokens)
        if blocks + reserve_units > self.pool.num_free():
            return True     # paged's own check refuses it
        page_aware = self.pool.page_aware
        try:
            self.machine_pool.hold(self.pool.books.pages_to_map(blocks, page_aware))
            return True
        except MapBudgetExhausted as exc:
            refused = exc
        if self.pool.give_back(self.pool.books.pages_to_map(blocks, page_aware)):
            try:
                self.machine_pool.hold(self.pool.books.pages_to_map(blocks, page_aware))
                return True
            except MapBudgetExhausted as exc:
                refused = exc
        self.pool_refusals += 1
        log.debug("elastic: %d blocks for sequence %d wait: %s", blocks, seq.seq_id, refused)
        return False

    def give_back(self, pages: int) -> None:
        """Another engine on the pool asks for `pages` driver pages: unmap whole chunks only cached blocks hold."""
        self.pool.give_back(pages)

    def stats(self) -> CacheStats:
        stats = super().stats()
        mem, books = self.memory.stats(), self.pool.books
        stats.reserved_bytes = self.geo.reserved_bytes
        stats.mapped_bytes = books.mapped_bytes()
        for key in ("num_mappings", "map_calls", "unmap_calls", "map_seconds", "unmap_seconds"):
            setattr(stats, key, mem[key])
        stats.extra.update({
            "page_size": self.geo.page_size, "chunk_bytes": self.geo.chunk_bytes,
            "blocks_per_chunk": self.geo.blocks_per_chunk, "mapped_chunks": len(books.mapped),
            "chunk_maps": books.chunk_maps, "chunk_unmaps": books.chunk_unmaps, "store_pages": mem["store_pages"],
            "cached_free_blocks": len(self.pool.cached_free), "cap_evictions": self.pool.cap_evictions,
            "chunks_given": self.pool.chunks_given, "pool_refusals": self.pool_refusals,
        })
        return stats

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        snap.update({"blocks_per_chunk": self.geo.blocks_per_chunk, "mapped_chunks": sorted(self.pool.books.mapped),
                     "cached_free": list(self.pool.cached_free)})
        return snap

    def check_invariants(self) -> None:
        super().check_invariants()
        pages = self.pool.books.mapped_bytes() // self.geo.page_size
        assert self.memory.closed or self.memory.mapped_pages() == pages, (
            f"the driver maps {self.memory.mapped_pages()} pages, the chunk books {pages}")

    def close(self) -> None:
        self.memory.close()
