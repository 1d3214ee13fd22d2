"""What the pool A/B found (docs/pool-ab.md): a refused take waits only while another engine published pages it
can give, and once per engine step; a pooled engine's capacity is what the pool can give it now; a request alone
on a full pool waits instead of failing; an idle server refreshes its pool block and shows its mapped bytes."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from helpers.pool_engines import BASE, LONGEST, PAGE, PARAMS, PROMPTS, Asks, pool_name, wait_for

from kvlab import LLM
from kvlab.common.handoff.book import HandoffStats
from kvlab.common.kv.types import CacheStats
from kvlab.common.metrics import RunMetrics
from kvlab.experiments.serve.engine_loop import EngineLoop
from kvlab.experiments.serve.prom import ServerMetrics
from kvlab.vmm import pool
from kvlab.vmm.drivers import pooled
from kvlab.vmm.drivers.pooled import PooledVirtualMemory, PoolExhausted

TENSORS = 8                     # the tiny model's pages in one page group (4 layers, K and V)


@pytest.fixture
def short_waits(monkeypatch):
    monkeypatch.setattr(pooled, "ANSWER_WAIT_S", 0.05)


def test_a_refused_take_waits_only_for_pages_others_can_give_and_once_a_step(short_waits):
    with pool.create(pool_name(), 64 * PAGE, page_size=PAGE, engine="busy") as busy:
        vm = PooledVirtualMemory(busy.name, PAGE)
        try:
            asks = Asks(vm.member)
            assert busy.take(64) is not None         # every page in use by the other engine: nothing to give
            with pytest.raises(PoolExhausted):
                vm.pool.hold(1)
            assert asks.count == 0                   # refused at once, no wait
            busy.publish(4)                          # it says it could give 4 (but never answers)
            for _ in range(2):
                with pytest.raises(PoolExhausted):
                    vm.pool.hold(1)
            assert asks.count == 1                   # one wait this step, then refusals at once
            vm.pool.begin_step()
            with pytest.raises(PoolExhausted):
                vm.pool.hold(1)
            assert asks.count == 2
        finally:
            vm.close()


def test_the_published_count_is_within_the_floor_and_gone_with_the_engine():
    with pool.create(pool_name(), 64 * PAGE, page_size=PAGE, engine="a") as a:
        b = pool.join(a.name, engine="b")
        assert b.take(10) is not None
        b.publish(50)                                # more than it holds: only its held pages count
        assert a.others_givable() == 10 and a.room() == 54 + 10
        pool.set_limits(a.name, "b", floor=6 * PAGE, ceiling=64 * PAGE)
        assert a.others_givable() == 4               # above its floor only
        b.close()
        assert a.others_givable() == 0 and a.room() == 64


def allocator_of(llm: LLM):
    return llm.engine.cache.allocator


def test_a_pooled_engines_capacity_is_what_the_pool_can_give_it_now():
    with pool.create(pool_name(), 64 * TENSORS * PAGE, page_size=PAGE, engine="other") as other:
        llm = LLM(**(BASE | {"kv_pool": other.name, "kv_cache_bytes": 64 * TENSORS * PAGE}))
        try:
            cache = allocator_of(llm)
            assert cache.num_free_units() == cache.num_total_units() == 64
            assert other.take(60 * TENSORS) is not None          # in use by the other engine
            assert cache.num_free_units() == 4
            other.publish(10 * TENSORS)                          # of which 10 groups could be given
            assert cache.num_free_units() == 14
            pool.set_limits(other.name, cache.driver.member.engine, floor=0,
                       ceiling=8 * TENSORS * PAGE)
            assert cache.num_free_units() == 8                   # within its own ceiling
        finally:
            llm.close()


@pytest.fixture(scope="module")
def alone() -> list[int]:
    llm = LLM(**BASE)
    try:
        return llm.generate([PROMPTS[-1]], PARAMS)[0].outputs[0].token_ids
    finally:
        llm.close()


@pytest.mark.parametrize("left, preempted", [(80, True), (16, False)])
def test_a_request_alone_on_a_full_pool_waits_for_pages_instead_of_failing(alone, left, preempted):
    """A hog holds all but `left` pages; the longest request needs 96. With 80 it starts, cannot grow and is
    preempted back to waiting; with 16 it cannot start. Either way it waits (not failed) until the hog gives its
    pages, then generates what it does alone."""
    with pool.create(pool_name(), LONGEST, page_size=PAGE, engine="hog") as hog:
        pages = hog.take(LONGEST // PAGE - left)
        llm = LLM(**(BASE | {"kv_pool": hog.name}))
        try:
            release = threading.Thread(target=give_when_waiting, args=(llm, hog, pages, preempted))
            release.start()
            out = llm.generate([PROMPTS[-1]], PARAMS)[0].outputs[0]
            release.join()
            assert out.finish_reason == "length" and out.token_ids == alone
            assert (llm.metrics().preemptions > 0) == preempted
        finally:
            llm.close()


def give_when_waiting(llm: LLM, hog: pool.PoolMember, pages: list[int], preempted: bool) -> None:
    if preempted:
        wait_for(lambda: llm.engine.scheduler.stats.preemptions > 0, "the request preempted for want of pages")
    else:
        time.sleep(1.5)                  # steps that admit nothing, past any one wait: the head must not fail
    hog.give(pages)


def test_a_request_that_can_never_fit_its_ceiling_still_fails():
    with pool.create(pool_name(), 64 * PAGE, page_size=PAGE, engine="holder") as holder:
        llm = LLM(**(BASE | {"kv_pool": holder.name}))
        try:
            out = llm.generate([PROMPTS[-1]], PARAMS)[0].outputs[0]      # 96 pages: more than the pool's 64
            assert out.finish_reason not in ("length", "stop")
        finally:
            llm.close()


# -- the server's view ------------------------------------------------------------------------------------------
class IdleEngine:
    """An engine with nothing to run whose pool block changes under it (its steward gave pages away)."""

    def __init__(self) -> None:
        self.engine_bytes, self.steps = 8 * PAGE, 0
        self.handoff = SimpleNamespace(stats=HandoffStats(), poll_idle=lambda: None)   # no role: totals stay 0

    def cache_stats(self) -> CacheStats:
        block = {"name": "p", "total_bytes": 64 * PAGE, "used_bytes": 8 * PAGE, "engine_bytes": self.engine_bytes,
                 "pages_given": 0, "pages_taken": 8}
        return CacheStats("vmm", "page", 8, total_units=8, used_units=0, free_units=8, mapped_bytes=3 * PAGE,
                          extra={"pool": block})

    def has_unfinished(self) -> bool:
        return False

    def metrics(self) -> RunMetrics:
        return RunMetrics("vmm")

    def queue_depths(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def close(self) -> None:
        pass


def test_an_idle_server_refreshes_its_pool_block_and_shows_its_mapped_bytes():
    engine, metrics = IdleEngine(), ServerMetrics("vmm")
    metrics.on_step(engine, 0, 0, 0, force=True)      # its last step
    assert metrics.stats()["pool"]["engine_bytes"] == 8 * PAGE
    loop = EngineLoop(engine, metrics, lambda batch: None)
    loop.start()
    try:
        engine.engine_bytes = 0                       # given away while idle: no step ran
        wait_for(lambda: metrics.stats()["pool"]["engine_bytes"] == 0, "the idle refresh")
        assert metrics.stats()["mapped_bytes"] == 3 * PAGE
        assert b"kvlab_mapped_bytes 12288.0" in metrics.text()
    finally:
        loop.stop()
