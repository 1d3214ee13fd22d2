"""A request alone on a pool that another engine holds full (docs/pool.md, What remains): preempted for the
transient shortage, it is not re-admitted while the room cannot hold it to its end, so it does not recompute its
prompt only to be preempted again at its next page group; once the other engine gives its pages back, it
completes with the tokens it generates alone."""
from __future__ import annotations

import pytest
from helpers.pool_engines import BASE, LONGEST, PAGE, PARAMS, PROMPTS, pool_name

from kvlab import LLM
from kvlab.vmm import pool

STEPS_HELD = 40             # steps while the other engine holds the pool: each could re-admit and re-preempt
MAX_STEPS = 500             # far more than the request's 24 tokens take, preemptions included


GROUP = 8                   # pages in one page group of the tiny model (4 layers, K and V)


def alone_tokens(overrides: dict) -> list[int]:
    llm = LLM(**(BASE | overrides))
    try:
        return llm.generate([PROMPTS[-1]], PARAMS)[0].outputs[0].token_ids
    finally:
        llm.close()


@pytest.mark.parametrize("chunk", [2048, 16])
def test_a_request_preempted_for_a_transient_shortage_waits_for_room_to_finish(chunk):
    """The hog leaves 80 pages; the longest request maps 72 for its prompt, 80 a page group later and 96 at its end:
    it is preempted at 81 tokens. Then the hog gives one group back (as a busy engine finishing a request would):
    enough to recompute and grow one group, not to finish. Re-admitted then, the request would be preempted again
    at 89 tokens; recomputed in chunks of 16 tokens, it would be re-admitted at once every time and preempted at
    its last chunk. Held back, it is preempted once and finishes when the hog gives the rest."""
    overrides = {"max_num_batched_tokens": chunk}
    with pool.create(pool_name(), LONGEST, page_size=PAGE, engine="hog") as hog:
        pages = hog.take(LONGEST // PAGE - 80)
        llm = LLM(**(BASE | overrides | {"kv_pool": hog.name}))
        try:
            engine, stats = llm.engine, llm.engine.scheduler.stats
            request_id = engine.add_request(PROMPTS[-1], PARAMS)
            for given in (pages[:GROUP], pages[GROUP:]):
                for _ in range(STEPS_HELD):
                    assert not engine.step().finished
                assert stats.preemptions == 1 and stats.recomputed_tokens == 80
                hog.give(given)
            outputs = run_to_end(engine)
            assert [o.request_id for o in outputs] == [request_id] and stats.preemptions == 1
            assert outputs[0].outputs[0].token_ids == alone_tokens(overrides)
        finally:
            llm.close()


def run_to_end(engine) -> list:
    finished = []
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return finished
        finished += engine.step().finished
    raise AssertionError(f"the request did not end in {MAX_STEPS} steps")


def test_a_held_request_whose_end_can_never_fit_comes_back_to_fail_alone():
    """A ceiling lowered below the request's end while it waits: holding it for room that can never come would
    hang it; it comes back, grows as far as the ceiling lets it and fails alone."""
    with pool.create(pool_name(), LONGEST, page_size=PAGE, engine="hog") as hog:
        pages = hog.take(LONGEST // PAGE - 80)
        llm = LLM(**(BASE | {"kv_pool": hog.name}))
        try:
            engine = llm.engine
            engine.add_request(PROMPTS[-1], PARAMS)
            for _ in range(STEPS_HELD):
                engine.step()
            assert engine.scheduler.stats.preemptions == 1
            pool.set_limits(hog.name, engine.cache.allocator.driver.member.engine, floor=0, ceiling=80 * PAGE)
            hog.give(pages)
            outputs = run_to_end(engine)
            assert outputs[0].outputs[0].finish_reason == "error"
        finally:
            llm.close()
