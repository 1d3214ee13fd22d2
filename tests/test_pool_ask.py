"""The wait beside busy engines (docs/pool.md, the elastic protocol): a busy engine gives only what is asked, so a
starved engine must ask for its growth's whole shortfall at once. Each tensor's page is mapped by its own driver
call; asking for one call's pages got them after one steward round, and the next tensor's map, refused with no
wait left in the step, undid the growth: one wait a step for every page of every tensor."""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvlab import LLM
from kvlab.vmm import pool
from tests.test_pool_engine import BASE, LONGEST, PAGE, PARAMS, PROMPTS, pool_name
from tests.test_pool_fixes import Asks

GROUPS = 4                  # the longest request's page-group allocations: its prompt's 9 groups, then 3 one by one


class BusyEngine:
    """Holds the whole pool, publishes it as givable and, asked, gives exactly what is wanted (as a busy engine
    gives its freed slots' pages), from its steward thread."""

    def __init__(self, member: pool.PoolMember) -> None:
        self.member, self.pages = member, member.take(member.total_pages)
        member.publish(len(self.pages))
        member.serve(self.answer)

    def answer(self, wanted: int) -> None:
        given, self.pages = self.pages[:wanted], self.pages[wanted:]
        self.member.give(given)
        self.member.publish(len(self.pages))


@dataclass(frozen=True)
class StarvedRun:
    tokens: list[int]
    asks: int
    seconds: float
    map_unmap_s: float
    preemptions: int


def starved_run() -> StarvedRun:
    """The longest test prompt on an engine whose pool a BusyEngine holds whole (tests/pool_ask_cost.py prints it)."""
    with pool.create(pool_name(), LONGEST, page_size=PAGE, engine="busy") as member:
        BusyEngine(member)
        llm = LLM(**(BASE | {"kv_pool": member.name}))
        try:
            asks = Asks(llm.engine.cache.allocator.driver.member)
            t0 = time.perf_counter()
            out = llm.generate([PROMPTS[-1]], PARAMS)[0].outputs[0]
            seconds, stats = time.perf_counter() - t0, llm.cache_stats()
            return StarvedRun(out.token_ids, asks.count, seconds, stats.map_seconds + stats.unmap_seconds,
                              llm.metrics().preemptions)
        finally:
            llm.close()


def test_a_starved_engine_asks_a_busy_one_for_its_whole_growth_at_once():
    alone = LLM(**BASE)
    try:
        expected = alone.generate([PROMPTS[-1]], PARAMS)[0].outputs[0].token_ids
    finally:
        alone.close()
    run = starved_run()
    assert run.tokens == expected
    assert run.asks <= GROUPS and run.preemptions == 0, (run.asks, run.seconds)
