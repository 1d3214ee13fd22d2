"""Allocator costs: host map/unmap per page, block allocate/free, per-token growth, share of a full run.

- map/unmap: vmm/host.py's HostVirtualMemory (memfd pages mapped with MAP_FIXED into a reserved range,
  MAP_POPULATE so the page-table cost is paid inside `map`), one page per call at scattered pool pages, timed
  per call through the driver API; the first round (memory allocated on first touch) is reported apart.
- block pool: paged/block_pool.py allocate then release, per operation.
- growth: what the scheduler asks every decode step, `can_allocate` + `allocate` one token further, through
  the accounting-only paged and vmm caches.
- share: CacheStats.allocator_seconds over the summed step time (RunMetrics.allocator_share) of a full
  engine run of the throughput workload.
"""
from __future__ import annotations

import random
import time

from kvlab.experiments.bench.perf.harness import Goal, Result, Settings, Timing, measure, timing_detail

FAMILY = "allocator"
SHARE_GOAL = Goal("<", 1.0)      # percent of step time
PAGE_SIZES = (4 * 1024, 64 * 1024, 2 * 1024 * 1024)
MAPPED_BYTES = 32 * 1024 * 1024  # per round, whatever the page size (at most 256 pages)
MAX_SHARE_REPEATS = 3


def label(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 1024} KiB"


def host_map_unmap(page_size: int, rounds: int, quick: bool) -> dict[str, Timing | float]:
    from kvlab.vmm.drivers.host import HostVirtualMemory
    pages = 8 if quick else max(8, min(256, MAPPED_BYTES // page_size))
    driver = HostVirtualMemory(page_size)
    try:
        region = driver.reserve(pages * page_size)
        t0 = time.perf_counter()
        driver.create_store(pages)              # allocates (zero-fills) the pages: the first touch is here
        created = (time.perf_counter() - t0) / pages
        order = list(range(pages))
        random.Random(0).shuffle(order)          # scattered pool pages: no two neighbours merge
        maps, unmaps, cold = [], [], []
        for r in range(rounds + 1):
            for i, page in enumerate(order):
                t0 = time.perf_counter()
                driver.map(region, i * page_size, page, 1)
                (cold if r == 0 else maps).append(time.perf_counter() - t0)
            for i in range(pages):
                t0 = time.perf_counter()
                driver.unmap(region, i * page_size, 1)
                unmaps.append(time.perf_counter() - t0)
        os_share = driver.stats.map_seconds / max(sum(cold) + sum(maps), 1e-12)
        driver.release(region)
    finally:
        driver.close()
    return {"map": Timing.of(maps), "unmap": Timing.of(unmaps), "cold_map": Timing.of(cold),
            "create_per_page": created, "os_share_of_map": os_share, "pages": pages}


def map_rows(settings: Settings) -> list[Result]:
    rows = []
    rounds = 2 if settings.quick else settings.repeats
    for size in PAGE_SIZES:
        m = host_map_unmap(size, rounds, settings.quick)
        for op in ("map", "unmap"):
            t = m[op]
            note = (f"store allocation {m['create_per_page'] * 1e6:.0f} us/page (at creation), first map "
                    f"{m['cold_map'].median * 1e6:.0f} us" if op == "map" else "")
            rows.append(Result(FAMILY, f"host {op}, {label(size)} page", t.median * 1e6, "us/page", note=note,
                               detail={**timing_detail(t), "p90_us": t.p90 * 1e6, "pages": m["pages"],
                                       "os_share_of_map": m["os_share_of_map"]}))
    return rows


def block_pool_rows(settings: Settings) -> list[Result]:
    from kvlab.paged.block_pool import BlockPool
    n = 1000 if settings.quick else 100_000
    pool = BlockPool(n)
    taken: list[int] = []

    def allocate_all() -> None:
        taken.extend(pool.allocate() for _ in range(n))

    def release_all() -> None:
        for block in reversed(taken):
            pool.release(block)
        taken.clear()
    alloc = measure_pair(allocate_all, release_all, settings.repeats)
    free = measure_pair(release_all, allocate_all, settings.repeats, timed_first=False)
    return [Result(FAMILY, "block pool allocate", alloc.median / n * 1e9, "ns/block", detail=timing_detail(alloc)),
            Result(FAMILY, "block pool release", free.median / n * 1e9, "ns/block", detail=timing_detail(free))]


def measure_pair(first, second, repeats: int, timed_first: bool = True) -> Timing:
    """Time `first` when timed_first else `second`, running both in turn (each undoes the other)."""
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        samples.append(t1 - t0 if timed_first else time.perf_counter() - t1)
    return Timing.of(samples[1:])


def growth_rows(settings: Settings) -> list[Result]:
    """can_allocate + allocate one token further, 16 sequences growing from 128 tokens to 128 + steps."""
    from kvlab.common.config import EngineConfig, make_config
    from kvlab.common.kv.seam import create_cache
    from kvlab.common.kv.types import KVShape
    from kvlab.common.sequence import Sequence
    shape = KVShape(num_layers=4, num_kv_heads=2, head_dim=64, num_q_heads=4)
    steps = 64 if settings.quick else 1024
    rows = []
    for backend in ("paged", "vmm"):
        config = make_config(backend=backend, max_num_seqs=16, max_model_len=2048, kv_cache_bytes=2**28)

        def grow(config: EngineConfig = config) -> None:
            cache = create_cache(config, shape, accounting_only=True).allocator
            seqs = [Sequence(i, str(i), [1] * 128, steps) for i in range(16)]
            for s in seqs:
                cache.allocate(s, 128)
                s.num_computed_tokens = 128
            for n in range(129, 129 + steps):
                for s in seqs:
                    cache.allocate(s, n)
                    s.num_computed_tokens = n
            cache.close()
        t = measure(grow, settings.repeats)
        rows.append(Result(FAMILY, f"{backend}: can_allocate + allocate per token", t.median / (16 * steps) * 1e6,
                           "us", note="accounting-only cache, 16 sequences growing", detail=timing_detail(t)))
    return rows


def share_rows(settings: Settings) -> list[Result]:
    from kvlab.experiments.bench.perf.throughput import engine_runner, make_requests, workload_for
    w = workload_for(settings)
    prompts, lens = make_requests(w, 1024, settings.seed)
    rows = []
    for backend in ("paged", "vmm"):
        llm, run = engine_runner(backend, w, settings, prompts, lens)
        shares, seconds = [], []
        try:
            for _ in range(min(settings.repeats, MAX_SHARE_REPEATS)):
                run()
                m = llm.metrics()
                shares.append(100 * m.allocator_share)
                seconds.append(m.allocator_seconds)
        finally:
            llm.close()
        t = Timing.of(shares)
        rows.append(Result(FAMILY, f"{backend}: allocator share of step time", t.median, "%", SHARE_GOAL,
                           note=f"allocator {1e3 * sorted(seconds)[len(seconds) // 2]:.1f} ms per run",
                           detail={"runs_percent": shares, "per_repeat": shares,
                                   "allocator_seconds": seconds}))
    return rows


def run(settings: Settings) -> list[Result]:
    return map_rows(settings) + block_pool_rows(settings) + growth_rows(settings) + share_rows(settings)
