"""The wait beside busy engines (docs/pool.md, the elastic protocol): a busy engine gives only what is asked, so a
starved engine must ask for its growth's whole shortfall at once. Each tensor's page is mapped by its own driver
call; asking for one call's pages got them after one steward round, and the next tensor's map, refused with no
wait left in the step, undid the growth: one wait a step for every page of every tensor."""
from __future__ import annotations

from helpers.pool_engines import BASE, PARAMS, PROMPTS, starved_run

from kvlab import LLM

GROUPS = 4                  # the longest request's page-group allocations: its prompt's 9 groups, then 3 one by one


def test_a_starved_engine_asks_a_busy_one_for_its_whole_growth_at_once():
    alone = LLM(**BASE)
    try:
        expected = alone.generate([PROMPTS[-1]], PARAMS)[0].outputs[0].token_ids
    finally:
        alone.close()
    run = starved_run()
    assert run.tokens == expected
    assert run.asks <= GROUPS and run.preemptions == 0, (run.asks, run.seconds)
