"""Engines on a machine-wide pool (issue 29, phase 2): the vmm host driver maps pool pages (taken in the ledger
before the mmap), a refused take preempts like a spent budget, idle engines give spare pages back to a starved
one, and a killed engine's pages come back. Outputs never change: greedy tokens equal a solo engine's."""
from __future__ import annotations

import os
import re
import signal

import pytest
from helpers.pool_engines import (
    BASE,
    DEADLINE_S,
    LONGEST,
    PAGE,
    PARAMS,
    PREFIX_PROMPTS,
    PROMPTS,
    pool_name,
    read_line,
    start_engine,
    wait_for,
)

from kvlab import LLM
from kvlab.common.errors import ConfigError
from kvlab.common.kv.types import CacheStats
from kvlab.common.metrics import RunMetrics
from kvlab.experiments.serve.prom import ServerMetrics
from kvlab.vmm import pool

POOL_KEYS = {"name", "total_bytes", "used_bytes", "engine_bytes", "pages_given", "pages_taken"}


def run(prompts: list[list[int]] = PROMPTS, **overrides) -> tuple[list[list[int]], dict, int]:
    """Greedy tokens, the pool block of the cache stats (or {}) and the preemptions of one engine's run; every
    request ran to its length."""
    llm = LLM(**(BASE | overrides))
    try:
        outputs = [r.outputs[0] for r in llm.generate(prompts, PARAMS)]
        assert [o.finish_reason for o in outputs] == ["length"] * len(prompts)
        if overrides.get("enable_prefix_caching"):
            assert llm.cache_stats().prefix_hit_tokens > 0
        return [o.token_ids for o in outputs], llm.cache_stats().extra.get("pool", {}), llm.metrics().preemptions
    finally:
        llm.close()


@pytest.fixture(scope="module")
def solo() -> list[list[int]]:
    return run()[0]


def test_an_engine_on_a_pool_generates_what_it_generates_alone(solo):
    name = pool_name()
    tokens, block, _ = run(kv_pool=name, kv_pool_bytes=16 << 20)
    assert tokens == solo
    assert set(block) == POOL_KEYS and block["name"] == name and block["total_bytes"] == 16 << 20
    assert block["pages_taken"] > 0 and 0 < block["engine_bytes"] <= block["used_bytes"]
    with pytest.raises(pool.UnknownPool):        # its only member closed: nothing of the pool is left
        pool.status(name)


def test_a_pool_smaller_than_the_budget_reuses_pages_and_outputs_stay_equal(solo):
    with pool.create(pool_name(), LONGEST, page_size=PAGE) as holder:
        tokens, block, _ = run(kv_pool=holder.name)
        assert tokens == solo and block["used_bytes"] <= LONGEST
        assert holder.status().used == 0           # the engine gave every page back when it closed


def test_a_refused_take_preempts_like_a_spent_budget():
    """Eight sequences at once on a pool that holds about three: refusals preempt, every request completes."""
    with pool.create(pool_name(), 1 << 20, page_size=PAGE) as holder:
        _, block, preemptions = run(kv_pool=holder.name, max_num_seqs=8)
        assert preemptions > 0 and block["used_bytes"] <= 1 << 20
        assert holder.status().used == 0           # the engine gave every page back when it closed


def test_prefix_caching_on_a_pool_generates_what_it_generates_alone():
    """Cached pages are kept, not spares: prompts that hit them read the K/V they wrote, on a pool smaller than the
    budget too (it evicts and reuses); the tokens equal a solo engine's with prefix caching."""
    alone = run(PREFIX_PROMPTS, enable_prefix_caching=True)[0]
    with pool.create(pool_name(), 4 * LONGEST, page_size=PAGE) as holder:
        tokens, block, _ = run(PREFIX_PROMPTS, kv_pool=holder.name, enable_prefix_caching=True)
        assert tokens == alone and 0 < block["used_bytes"] <= 4 * LONGEST
        assert holder.status().used == 0


def test_the_page_size_must_be_the_pools():
    with pool.create(pool_name(), 1 << 20, page_size=2 * PAGE) as holder:
        with pytest.raises(ConfigError, match="page size 8192"):
            LLM(**BASE, kv_pool=holder.name)
        assert holder.status().used == 0 and len(holder.status().engines) == 1


@pytest.mark.parametrize("overrides, match", [
    ({"backend": "paged", "kv_pool": "p"}, "kv_pool needs a backend whose pages are mapped on demand"),
    ({"kv_pool_bytes": 1 << 20}, "kv_pool_bytes needs kv_pool"),
    ({"kv_pool": "no-such-pool-here"}, "no pool named"),
])
def test_pool_options_are_one_line_errors(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        LLM(**(BASE | overrides))
    assert "\n" not in str(e.value)


# -- engines in other processes (helpers.pool_engines.start_engine) -----------------------------------------
def test_an_idle_engine_feeds_a_starved_one_and_outputs_stay_equal(solo):
    """Engine A runs and idles holding its freed slots' pages, most of the pool; engine B (this process) is
    refused, asks, and A's steward gives its spares back; both generate exactly what a solo engine does."""
    with pool.create(pool_name(), LONGEST + 32 * PAGE, page_size=PAGE) as holder:
        a = start_engine(holder.name)
        try:
            first = read_line(a)
            assert first["tokens"] == solo
            held_by_a = first["pool"]["engine_bytes"]
            assert held_by_a > 32 * PAGE                      # B cannot run without A's pages
            tokens, block, _ = run(kv_pool=holder.name)
            assert tokens == solo and block["pages_taken"] * PAGE > LONGEST + 32 * PAGE - held_by_a
            a.stdin.write("\n")
            a.stdin.flush()
            assert read_line(a)["pages_given"] > 0            # A gave pages back while idle
            assert a.wait(DEADLINE_S) == 0
        finally:
            a.kill()
            a.wait()
        assert holder.status().used == 0


def test_an_idle_engine_with_a_warm_prefix_cache_feeds_a_starved_one(solo):
    """Engine A caches prefixes and idles: most of what it holds is kept cache pages, not spares. A hog takes the
    pool's free pages but 16; engine B (this process) is refused and asks; A's steward evicts idle cached groups
    (whole groups, above its floor) and gives their pages; B generates what a solo engine does."""
    with pool.create(pool_name(), 512 * PAGE, page_size=PAGE) as holder:
        a = start_engine(holder.name, "prefix")
        hog = None
        try:
            first = read_line(a)
            kept = first["cached"] * 8                       # 8 pages (tensors) a cached group
            assert kept * PAGE > LONGEST and first["pool"]["engine_bytes"] >= kept * PAGE
            hog = pool.join(holder.name, engine="hog")
            assert hog.take(holder.status().free - 16) is not None
            tokens, block, _ = run(kv_pool=holder.name)
            assert tokens == solo and block["pages_taken"] * PAGE >= LONGEST
            a.stdin.write("\n")
            a.stdin.flush()
            last = read_line(a)
            assert last["prefix_evictions"] > 0 and last["pages_given"] > 0
            assert a.wait(DEADLINE_S) == 0
        finally:
            if hog is not None:
                hog.close()
            a.kill()
            a.wait()
        assert holder.status().used == 0


def test_kill_9_of_an_engine_returns_its_pages():
    with pool.create(pool_name(), 4 << 20, page_size=PAGE) as holder:
        a = start_engine(holder.name)
        try:
            assert read_line(a)["pool"]["engine_bytes"] > 0
            assert holder.status().used > 0
            os.kill(a.pid, signal.SIGKILL)
            a.wait()
            wait_for(lambda: holder.status().used == 0, "the killed engine's pages")
            assert [e.name for e in holder.status().engines] == [holder.engine]
        finally:
            a.kill()
            a.wait()


# -- the server's view ------------------------------------------------------------------------------------------
class PoolEngine:
    """What ServerMetrics reads of an engine: cache stats with a pool block, and run metrics."""

    def __init__(self, block: dict) -> None:
        self.stats = CacheStats("vmm", "page", 4, total_units=10, used_units=4, free_units=6, extra={"pool": block})

    def cache_stats(self) -> CacheStats:
        return self.stats

    def metrics(self) -> RunMetrics:
        return RunMetrics("vmm")


def test_stats_and_metrics_carry_the_pool_block():
    block = {"name": "p", "total_bytes": 1 << 20, "used_bytes": 1 << 19, "engine_bytes": 1 << 18,
             "pages_given": 3, "pages_taken": 70}
    m = ServerMetrics("vmm")
    for _ in range(2):                                 # counters go to the running totals, not up by them
        m.on_step(PoolEngine(block), 1, 0, 0, force=True)
    assert m.stats()["pool"] == block
    text = m.text().decode()
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))      # noqa: E731
    assert (value("kvlab_pool_total_bytes"), value("kvlab_pool_used_bytes"), value("kvlab_pool_engine_bytes")) \
        == (1 << 20, 1 << 19, 1 << 18)
    assert (value("kvlab_pool_pages_given_total"), value("kvlab_pool_pages_taken_total")) == (3, 70)
