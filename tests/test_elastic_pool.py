"""Elastic engines on the simulated shared pool (experiments/sim/pool/shared.py, `shared:elastic-BLOCK`): an idle
engine whose warm prefix cache keeps chunks mapped gives whole chunks back when another engine asks; a growth the
pool cannot hold is refused before anything changes; the pool never lends more than it has; and one model without
bursts runs the same on the pool as on a static split."""
from __future__ import annotations

import pytest
from helpers.invariants import SHAPE

from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.common.sequence import Sequence
from kvlab.experiments.sim.pool import shared
from kvlab.experiments.sim.pool.onoff import OnOff
from kvlab.experiments.sim.pool.run import PoolSpec, parse_arrangements, run_point
from kvlab.experiments.sim.serve.run import ServeSpec

PAGE = 4096
BUDGET = 64 * 1024     # SHAPE, 4-token blocks: 1 KiB a block in each of 4 planes, 16 blocks, 4 a one-page chunk
SMALL = ServeSpec(dataset="random", input_len=200, output_len=40, range_ratio=0.5, model_prefill=True,
                  driver_profile="cuda-a100", background_mapping=False)
SLO = {"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}


def engine(pool: shared.SharedPages, prefix: bool = True):
    config = make_config(backend="elastic", kv_cache_bytes=BUDGET, enable_prefix_caching=prefix,
                         elastic_page_size=PAGE, elastic_block_size=4, max_model_len=64)
    return shared.build_elastic_cache(config, SHAPE, shared.PooledAccountingMemory(PAGE, pool.join(), True)).allocator


def sequence(seq_id: int, first: int, n: int) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(range(first, first + n)), max_tokens=8)


def test_an_idle_engine_gives_back_whole_cached_chunks_when_another_asks():
    pool = shared.SharedPages(BUDGET // PAGE)        # 16 pages: 4 chunks of 4 (one page in each plane)
    idle, busy = engine(pool), engine(pool)
    seq = sequence(1, 3, 40)
    assert idle.allocate(seq, 40) == 0
    seq.num_computed_tokens = 40
    idle.free(seq)                                   # 10 cached blocks keep 3 chunks mapped: 12 pages
    assert pool.held == 12 and idle.pool.givable_pages() == 12
    # 12 blocks (3 chunks) for the busy engine: 4 pages are free, so the idle one is asked for 8, whole chunks
    assert busy.allocate(sequence(2, 500, 48), 48) == 0
    assert busy.driver.budget.held == 12 and idle.driver.budget.held == 4 and pool.held <= pool.pages
    assert pool.pages_moved == 8 and idle.stats().extra["chunks_given"] == 2
    assert idle.stats().extra["cached_free_blocks"] == 4      # the fullest chunk's cache survives
    idle.check_invariants()
    busy.check_invariants()


def test_a_growth_the_pool_cannot_hold_is_refused_before_anything_changes():
    pool = shared.SharedPages(BUDGET // PAGE)
    first, second = engine(pool, prefix=False), engine(pool, prefix=False)
    assert first.allocate(sequence(1, 3, 40), 40) == 0        # live blocks: nothing to give back
    before = second.snapshot()
    assert second.allocate(sequence(2, 500, 24), 24) is None  # 6 blocks, 2 chunks: 8 pages, 4 free
    assert second.snapshot() == before and second.driver.budget.held == 0
    assert second.stats().extra["pool_refusals"] == 1
    assert second.allocate(sequence(3, 900, 16), 16) == 0     # one chunk fits
    first.check_invariants()
    second.check_invariants()


def test_shared_elastic_arrangements():
    arr = parse_arrangements(["shared:elastic-16"], 30.0, 0.05)[0]
    assert arr.case.options == {"elastic_block_size": 16, "elastic_page_size": 2 * 2**20}
    assert arr.label == "shared elastic-16-2MiB" and arr.engine_case(3).budget_gb == 30.0
    assert parse_arrangements(["split:elastic-16"], 30.0, 0.05)[0].case.options == {"elastic_block_size": 16}
    with pytest.raises(ConfigError, match="only vmm engines"):
        parse_arrangements(["aware:elastic-16"], 30.0, 0.05)


def test_one_elastic_model_without_bursts_agrees_on_the_pool_and_the_split():
    spec = PoolSpec(SMALL, OnOff(models=1, period_s=20, periods=1), SLO)
    shared_run, split_run = (run_point(a, spec, 6.0, 0) for a in parse_arrangements(
        ["shared:elastic-16-64KiB", "split:elastic-16-64KiB"], 0.3, 0.05))
    assert shared_run["num_prompts"] > 50 and shared_run["pages_moved"] == 0
    strip = lambda r: {k: v for k, v in r.items() if k not in ("arrangement", "per_model")}   # noqa: E731
    assert strip(shared_run) == strip(split_run)


def test_elastic_engines_on_the_pool_never_hold_more_than_it_has(monkeypatch):
    seen = []
    check = shared.PoolShare.check

    def watched(self, delta, call):
        check(self, delta, call)
        seen.append(self.pool.held + max(delta, 0) <= self.pool.pages)
    monkeypatch.setattr(shared.PoolShare, "check", watched)
    spec = PoolSpec(SMALL, OnOff(models=2, period_s=10, periods=2), SLO)
    r = run_point(parse_arrangements(["shared:elastic-16-64KiB"], 0.25, 0.05)[0], spec, 14.0, 1)
    assert seen and all(seen) and r["num_prompts"] > 100
    assert sum(m["pages_received"] for m in r["per_model"]) == r["pages_moved"]
