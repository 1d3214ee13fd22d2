"""The elastic allocator: paged's allocator (block tables, reference counts, copy-on-write, prefix caching, swap)
over an `ElasticBlockPool`, whose chunks of virtual memory are mapped when a block in them is first needed and
unmapped when none is held. Bookkeeping and the mapping calls only; the storage reads the same memory through a
view (elastic/storage.py)."""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import ConfigError
from kvlab.common.kv.seam import timed
from kvlab.common.kv.types import CacheStats, KVShape
from kvlab.elastic.block_pool import ElasticBlockPool
from kvlab.elastic.chunks import ChunkBooks
from kvlab.elastic.compaction import compact
from kvlab.elastic.geometry import ChunkGeometry
from kvlab.elastic.memory import ElasticMemory, driver_page_size, open_driver
from kvlab.elastic.pooling import PoolSeat
from kvlab.paged.allocator import PagedAllocator
from kvlab.vmm.drivers.machine_pool import NO_POOL

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.drivers.base import VirtualMemory


def locked(method: Callable) -> Callable:
    """`method` under the allocator's lock (the pool's steward thread gives chunks back under it too)."""
    @functools.wraps(method)
    def call(self: ElasticAllocator, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)
    return call


class ElasticAllocator(PagedAllocator):
    name = "elastic"

    def __init__(self, config: EngineConfig, shape: KVShape, accounting_only: bool = False,
                 driver: VirtualMemory | None = None) -> None:
        """`driver`: the caller's (the simulated shared pool's); else the device's, over `kv_pool` if set."""
        opts = config.options_of("elastic")
        if opts.elastic_compact >= 0 and config.kv_role != "colocated":
            raise ConfigError(f"elastic_compact moves blocks that a KV handoff may be reading from another thread; "
                              f"it is for colocated engines, not kv_role {config.kv_role!r}: use one of them")
        super().__init__(config.replace(block_size=opts.elastic_block_size), shape)
        self.compact_spare, self.compaction_moves = opts.elastic_compact, 0      # -1: never move blocks
        if driver is None:
            driver = open_driver(shape.device, opts.elastic_page_size, accounting_only, config.kv_pool,
                                 config.kv_pool_bytes)
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
        self.lock = threading.RLock()
        self.machine_pool = driver.pool
        self.seat = PoolSeat(driver.pool, self.pool, self.lock)

    units_needed = locked(PagedAllocator.units_needed)
    fork = locked(PagedAllocator.fork)

    @locked
    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._compact()

    @locked
    def swap_out(self, seq: Sequence) -> None:
        super().swap_out(seq)
        self._compact()

    @timed
    def _compact(self) -> None:
        if self.compact_spare >= 0:
            self.compaction_moves += compact(self.pool, self.seqs.values(), self.block_size, self.emit,
                                             self.compact_spare)

    @locked
    def num_free_units(self) -> int:
        """On a pool: the free blocks the pool can back now, not the whole budget's."""
        return self.seat.free_blocks()

    def begin_step(self) -> None:
        self.machine_pool.begin_step()

    def shortage_is_transient(self, seq: Sequence, num_tokens: int) -> bool:
        """On a pool other engines hold memory that comes back: a sequence within the engine's share fits later."""
        if not self.machine_pool.elastic or num_tokens > self.max_tokens_per_seq():
            return False
        return -(-num_tokens // self.block_size) <= self.seat.ceiling_blocks()

    @locked
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        hit = self._allocate(seq, num_tokens, reserve_units)
        if self.compact_spare >= 0:   # a window may have dropped blocks; chunk 0 may be mapped again as padding
            self._compact()
        return hit

    def _allocate(self, seq: Sequence, num_tokens: int, reserve_units: int) -> int | None:
        if self.machine_pool is NO_POOL:
            return super().allocate(seq, num_tokens, reserve_units)
        blocks = self.units_needed(seq, num_tokens)
        if blocks + reserve_units <= self.pool.num_free() and not self.seat.hold(blocks):
            return None
        try:
            return super().allocate(seq, num_tokens, reserve_units)
        finally:
            self.seat.let_go()

    @locked
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        if self.machine_pool is NO_POOL or seq.seq_id not in self.swapped:
            return super().swap_in(seq, reserve_units)
        blocks = self.units_needed(seq, seq.num_computed_tokens)
        if blocks + reserve_units <= self.pool.num_free() and not self.seat.hold(blocks):
            return False
        try:
            return super().swap_in(seq, reserve_units)
        finally:
            self.seat.let_go()

    def give_back(self, pages: int) -> None:
        """Another engine on the pool asks for `pages` driver pages: unmap whole chunks only cached blocks hold."""
        self.seat.give_back(pages)

    @locked
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
            "chunks_given": self.pool.chunks_given, "pool_refusals": self.seat.refusals,
            "compaction_moves": self.compaction_moves,
            **({"pool": pool} if (pool := self.machine_pool.stats()) else {}),
        })
        return stats

    @locked
    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        snap.update({"blocks_per_chunk": self.geo.blocks_per_chunk, "mapped_chunks": sorted(self.pool.books.mapped),
                     "cached_free": list(self.pool.cached_free)})
        return snap

    @locked
    def check_invariants(self) -> None:
        super().check_invariants()
        pages = self.pool.books.mapped_bytes() // self.geo.page_size
        assert self.memory.closed or self.memory.mapped_pages() == pages, (
            f"the driver maps {self.memory.mapped_pages()} pages, the chunk books {pages}")

    def close(self) -> None:
        with self.lock:              # a give-back running on the pool's steward thread finishes first
            self.seat.closed = True
        self.memory.close()
