"""One elastic page pool for several simulated vmm or elastic engines: the accounting-only counterpart of vmm/pool/.

Every engine's accounting driver checks its maps with the pool (`PoolShare`, the budget its mapping count checks
before a map, never after); the pool holds `pages` physical pages for all engines together, and an engine's share
is its driver's mapped pages (CUDA mappings never merge: each mapped page is one physical page).
An engine whose map would pass the total first asks the other engines for pages: each answers with its
allocator's own `give_back` (the call the real pool's steward makes), which unmaps its freed slots' parked pages.
Only then is the map refused (MapBudgetExhausted: the vmm then drops its own parked pages and retries, then the
scheduler waits or preempts, as with a real pool). An unmapped page is back in the pool at once (no spares are
held: in the accounting world there is no memory to keep), and floors are 0.

An elastic engine (paged blocks over chunks mapped on demand, kvlab/elastic/) holds the pages a growth may map in
the pool before it maps (`HoldingPool`: paged's allocation cannot be undone halfway), and answers asks by forgetting
the cached blocks of chunks nothing else holds, which unmaps them whole; its parked pages are those chunks'.

Driver costs: a given page's cuMemUnmap is charged to the engine that asked for it (it waits for the give-back),
not to the giver, which may be idle and step no more; the asker's cuMemMap of the page is its own map."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.common.kv.seam import KVCache, NullStorage
from kvlab.vmm.allocator import VMMAllocator
from kvlab.vmm.drivers.accounting import AccountingVirtualMemory
from kvlab.vmm.drivers.machine_pool import NoPool
from kvlab.vmm.drivers.map_budget import MapBudgetExhausted, MappingCount


class SharedPages:
    """The pool's books: pages held by all engines against the total."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.shares: list[PoolShare] = []
        self.pages_moved = 0         # pages given back on request, over the run

    @property
    def held(self) -> int:
        return sum(share.held for share in self.shares)

    def join(self) -> PoolShare:
        share = PoolShare(self)
        self.shares.append(share)
        return share

    def obtainable(self) -> int:
        """Pages an engine could map now: the free ones and every engine's parked (freed slots') pages."""
        return self.pages - self.held + sum(share.parked() for share in self.shares)

    def reclaim(self, asker: PoolShare, wanted: int) -> None:
        """Ask every other engine to give back pages it holds without need, until `wanted` are free."""
        for share in self.shares:
            if self.pages - self.held >= wanted:
                return
            if share is not asker and share.answer is not None:
                freed = share.give_back(wanted - (self.pages - self.held))
                asker.unmapped_for_me += freed
                self.pages_moved += freed


class PoolShare:
    """One engine's account in the pool: the `budget` its driver's MappingCount checks and books."""

    def __init__(self, pool: SharedPages) -> None:
        self.pool = pool
        self.answer: Callable[[int], None] | None = None    # the allocator's give_back
        self.driver: AccountingVirtualMemory | None = None
        self.parked: Callable[[], int] = lambda: 0     # the allocator's parked pages (build_cache sets it)
        self.unmapped_for_me = 0        # pages other engines unmapped to give this one room
        self.unmapped_for_others = 0    # pages this engine unmapped to give others room

    @property
    def held(self) -> int:
        return self.driver.stats.mapped_pages if self.driver is not None else 0

    def check(self, delta: int, call: str) -> None:
        pool = self.pool
        if delta <= 0 or pool.held + delta <= pool.pages:
            return
        pool.reclaim(self, delta)     # `wanted` is the free pages the map needs, not the shortfall
        free = pool.pages - pool.held
        if delta > free:
            raise MapBudgetExhausted(f"{call} needs {delta} pages; the shared pool has {free} of {pool.pages} free")

    def add(self, delta: int) -> None:
        """Booked by the driver itself (its mapped pages are the share)."""

    def give_back(self, wanted: int) -> int:
        """The allocator's answer to `wanted`; returns the pages it unmapped."""
        stats = self.driver.stats
        before = stats.pages_unmapped
        self.answer(wanted)
        freed = stats.pages_unmapped - before
        self.unmapped_for_others += freed
        return freed


class PooledAccountingMemory(AccountingVirtualMemory):
    """The accounting driver, its mapped pages booked in a shared pool (never merged: CUDA's rule)."""

    def __init__(self, page_size: int, share: PoolShare, holds: bool = False) -> None:
        super().__init__(page_size, merges=False)
        self.budget = share
        self.mappings = MappingCount(self.stats, None, share)
        self.pool = HoldingPool(share) if holds else SimulatedPool(share)
        share.driver = self


class SimulatedPool(NoPool):
    """The allocator's view of the simulated pool (vmm/drivers/machine_pool.py): its give_back answers other
    engines; no spares (an unmapped page went back to the pool when it was unmapped), no floors (every mapped page
    may be given); capacity is the engine's own (not elastic), the pool being a map budget."""

    def __init__(self, share: PoolShare) -> None:
        self.share = share

    def answer_asks(self, give_back: Callable[[int], None], givable: Callable[[], int]) -> None:
        self.share.answer = give_back

    def above_floor(self) -> int:
        return self.share.held


class HoldingPool(SimulatedPool):
    """An elastic engine's view: `hold` asks the pool for the pages now (others give theirs back first), so the maps
    that follow in the same step cannot be refused (nothing else runs between them in the simulator)."""

    def hold(self, pages: int) -> None:
        self.share.check(pages, "hold")


def build_elastic_cache(config: Any, shape: Any, driver: PooledAccountingMemory) -> KVCache:
    """An accounting-only elastic cache over the pool's driver (its block pool the whole budget's blocks)."""
    from kvlab.elastic.allocator import ElasticAllocator
    allocator = ElasticAllocator(config, shape, accounting_only=True, driver=driver)
    driver.budget.parked = allocator.pool.givable_pages
    return KVCache(allocator=allocator, storage=NullStorage(), shape=shape)


def build_cache(config: Any, shape: Any, driver: PooledAccountingMemory, aware: bool) -> KVCache:
    """An accounting-only vmm cache over the pool's driver; `aware`: with the pool-aware fit test, a what-if of the
    engine's admission (vmm/ is unchanged): the scheduler's fit test also asks the pool, so growth, and the
    admission watermark, count against the pages every engine could still get (the pool's free pages and every
    engine's reclaimable parked pages), not only against this engine's own address space."""
    allocator = VMMAllocator(config, shape, driver)
    if aware:
        allocator.also_fits = lambda units: units * allocator.geo.num_tensors <= driver.budget.pool.obtainable()
    driver.budget.parked = lambda: allocator.table.excess * allocator.geo.num_tensors
    return KVCache(allocator=allocator, storage=NullStorage(), shape=shape)
