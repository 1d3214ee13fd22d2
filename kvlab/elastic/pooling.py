"""An elastic engine's dealings with a machine-wide page pool (docs/pool.md "Elastic engines on the pool"), through
the `MachinePool` its driver carries (vmm/drivers/machine_pool.py; `NO_POOL` alone, the simulator's `HoldingPool`).

Before an allocation maps anything, the pages it may map are held in the pool (all or nothing: paged's allocation
is not undone halfway); the hold is an upper bound (`ChunkBooks.pages_to_map`), so what the allocation did not map
is let go right after it, and an engine holds no pool page beyond its mapped chunks (and its floor). Other engines'
asks are answered from the pool's steward thread under the allocator's lock: whole chunks that only cached blocks
hold are forgotten, which unmaps them and gives their pages back.
"""
from __future__ import annotations

import logging
import threading

from kvlab.elastic.block_pool import ElasticBlockPool
from kvlab.vmm.drivers.machine_pool import MachinePool
from kvlab.vmm.drivers.map_budget import MapBudgetExhausted

log = logging.getLogger("kvlab.elastic")


class PoolSeat:
    """Holds before maps, the let-go after them, the answer to asks, and the engine's capacity on the pool."""

    def __init__(self, pool: MachinePool, blocks: ElasticBlockPool, lock: threading.RLock) -> None:
        self.pool, self.blocks, self.lock = pool, blocks, lock
        geo = blocks.books.geo
        self.chunk_pages, self.blocks_per_chunk = geo.planes * geo.pages_per_chunk, geo.blocks_per_chunk
        self.refusals = 0
        self.closed = False     # the allocator closed: answer nothing
        pool.answer_asks(self.give_back, self.givable_pages)

    def hold(self, blocks: int) -> bool:
        """Hold the pages taking `blocks` free blocks may map; refused, give back this engine's own cached chunks
        and try once more. Still refused: False (out of room, like out of KV), counted."""
        books, aware = self.blocks.books, self.blocks.page_aware
        try:
            self.pool.hold(books.pages_to_map(blocks, aware))
            return True
        except MapBudgetExhausted as exc:
            refused = exc
        if self.blocks.give_back(books.pages_to_map(blocks, aware)):
            try:
                self.pool.hold(books.pages_to_map(blocks, aware))
                return True
            except MapBudgetExhausted as exc:
                refused = exc
        self.refusals += 1
        log.debug("elastic: %d blocks wait: %s", blocks, refused)
        return False

    def let_go(self) -> None:
        """Give back what a hold took and the maps did not use."""
        if spare := self.pool.spare_pages():
            self.pool.give_spare(spare)

    def give_back(self, wanted: int) -> None:
        """Other engines want `wanted` pages: spares first, then whole chunks only cached blocks hold, fewest
        blocks first, never below the engine's floor."""
        with self.lock:
            if self.closed:
                return
            given = self.pool.give_spare(wanted)
            if given < wanted:
                self.blocks.give_back(wanted - given, self.pool.above_floor())

    def givable_pages(self) -> int:
        """Published to the pool each steward round: spares and the pages of chunks only cached blocks hold."""
        with self.lock:
            return 0 if self.closed else self.pool.spare_pages() + self.blocks.givable_pages()

    def free_blocks(self) -> int:
        """Free blocks the pool can back now: those in mapped chunks (free or cached) and whole chunks of the
        pages the pool could give (a hint, as vmm's: the hold decides)."""
        free = self.blocks.num_free()
        if not self.pool.elastic:
            return free
        mapped = self.blocks.books.num_loose + len(self.blocks.cached_free)
        return min(free, mapped + self.pool.room_pages() // self.chunk_pages * self.blocks_per_chunk)

    def ceiling_blocks(self) -> int:
        """The most blocks the engine's share of the pool maps (whole chunks)."""
        return self.pool.ceiling_pages() // self.chunk_pages * self.blocks_per_chunk
