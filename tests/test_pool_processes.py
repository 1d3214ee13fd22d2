"""The pool across processes (issue 29): engines in separate processes take and give pages against a nearly full
pool, each writing its pid into its pages through a MAP_FIXED mapping and checking them, while members are
killed -9 and limits change. `RemoteMember` (helpers/pool_workers.py) runs one engine in a subprocess, driven by
JSON lines on its stdin; every read has a deadline, every worker exits when its stdin closes, and every test kills
what it started."""
from __future__ import annotations

import os
import select
import time

import pytest
from helpers.pool_workers import PAGE, RemoteMember, books, leftovers

from kvlab.vmm import pool
from kvlab.vmm.pool.status import PoolStatus

REAP_BOUND_S = 3.0        # two steward intervals (0.2 s) with room for a loaded 2-core machine


@pytest.fixture
def spawn():
    """spawn(name, engine, create_bytes=0) -> RemoteMember; all killed at the end."""
    started: list[RemoteMember] = []

    def start(name: str, engine: str, create_bytes: int = 0, lifetime_s: int = 300) -> RemoteMember:
        started.append(RemoteMember(name, engine, create_bytes, lifetime_s))
        return started[-1]
    yield start
    for worker in started:
        worker.close()


def pool_name(tag: str) -> str:
    return f"test-{tag}-{os.getpid()}"


def check_books(s: PoolStatus) -> None:
    held = sum(e.held for e in s.engines)
    assert s.used == held and 0 <= s.free <= s.total, s


def wait_for(condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def run_race(spawn, workers: int, ops: int, lifetime_s: int = 300) -> None:
    name = pool_name("race")
    with pool.create(name, 64 * PAGE, PAGE, engine="observer", ceiling=0) as observer:
        members = [spawn(name, f"w{i}", lifetime_s=lifetime_s) for i in range(workers)]
        for i, w in enumerate(members):
            w.send("race", ops=ops // workers, seed=i, most=6, take_share=0.6)
        samples = 0
        while any(not select.select([w.proc.stdout], [], [], 0)[0] for w in members):
            check_books(books(observer))          # sampled while they race: always whole
            samples += 1
            time.sleep(0.002)
        results = [w.read(lifetime_s) for w in members]
        s = books(observer)
        check_books(s)
        for w, result in zip(members, results):
            assert s.engine(w.engine).held == len(result["held"])
        all_held = [p for r in results for p in r["held"]]
        assert len(all_held) == len(set(all_held)) == s.used
        assert sum(r["refused"] for r in results) > 0 and samples > 0      # the pool really ran short


def test_a_race_of_4_engines_on_a_nearly_full_pool(spawn):
    run_race(spawn, workers=4, ops=8_000)


@pytest.mark.slow
def test_a_race_of_100000_operations(spawn):
    run_race(spawn, workers=4, ops=100_000, lifetime_s=900)


def test_a_killed_engine_pages_come_back_within_the_bound(spawn):
    name = pool_name("kill")
    with pool.create(name, 64 * PAGE, PAGE, engine="observer", ceiling=0) as observer:
        victim, survivor = spawn(name, "victim"), spawn(name, "survivor")
        assert len(victim.call("take", n=20)) == 20
        survivor.send("race", ops=3_000, seed=1, most=6, take_share=0.6)
        victim.send("race", ops=1_000_000, seed=2, most=6, take_share=0.6)
        time.sleep(0.3)
        victim.kill()
        elapsed = wait_for(lambda: books(observer).engine("victim") is None, REAP_BOUND_S)
        s = books(observer)
        check_books(s)
        assert s.reclaimed_engines == 1 and elapsed < REAP_BOUND_S
        result = survivor.read()
        assert books(observer).engine("survivor").held == len(result["held"])


def test_an_engine_killed_inside_a_change_leaves_whole_books(spawn):
    name = pool_name("torn")
    with pool.create(name, 16 * PAGE, PAGE, engine="observer", ceiling=0) as observer:
        victim, other = spawn(name, "victim"), spawn(name, "other")
        other.call("take", n=4)
        victim.send("die_inside_a_change")
        victim.proc.wait(10)
        wait_for(lambda: books(observer).engine("victim") is None, REAP_BOUND_S)
        s = books(observer)
        assert (s.free, s.engine("other").held) == (12, 4)
        assert len(other.call("take", n=12)) == 12


def test_the_pool_outlives_its_creator_and_another_member_serves_joins(spawn):
    name = pool_name("creator")
    creator = spawn(name, "creator", create_bytes=32 * PAGE)
    survivor = spawn(name, "survivor")
    creator.call("take", n=10)
    survivor.call("take", n=5)
    creator.kill()
    with pool.join(name, engine="late") as late:
        wait_for(lambda: books(late).engine("creator") is None, REAP_BOUND_S)
        assert late.take(27) is not None and late.take(1) is None
        assert len(survivor.call("check")) == 5


def test_limits_changed_under_load_take_effect(spawn):
    name = pool_name("limits")
    with pool.create(name, 48 * PAGE, PAGE, engine="observer", ceiling=0) as observer:
        workers = [spawn(name, f"w{i}") for i in range(3)]
        for i, w in enumerate(workers):
            w.send("race", ops=3_000, seed=i, most=6, take_share=0.6)
        time.sleep(0.2)
        pool.set_limits(name, "w0", ceiling=2 * PAGE)
        pool.set_limits(name, "w1", floor=16 * PAGE)
        first = books(observer)
        floors_met = False
        while any(not select.select([w.proc.stdout], [], [], 0)[0] for w in workers):
            s = books(observer)
            w0 = s.engine("w0")
            assert w0.ceiling == 2 and s.engine("w1").floor == 16
            if w0.held > 2:                 # still above its new ceiling: it has taken nothing since
                assert w0.taken == first.engine("w0").taken
            floors_met = floors_met or s.free >= s.reserved
            assert s.free >= s.reserved or not floors_met      # once kept, the floor stays kept
            time.sleep(0.002)
        for w in workers:
            w.read()
        assert books(observer).engine("w0").held <= 2


def test_nothing_outlives_the_last_member_even_after_kill_9(spawn):
    name = pool_name("gone")
    members = [spawn(name, "creator", create_bytes=16 * PAGE), spawn(name, "a"), spawn(name, "b")]
    for m in members:
        m.call("take", n=3)
    assert pool.status(name).used == 9
    assert leftovers(name)
    for m in members:
        m.kill()
    assert leftovers(name) == []
    with pytest.raises(pool.UnknownPool):
        pool.status(name)


def test_nothing_outlives_members_that_close(spawn):
    name = pool_name("closed")
    creator = spawn(name, "creator", create_bytes=16 * PAGE)
    with pool.join(name) as member:
        member.take(2)
    creator.close()
    assert leftovers(name) == []
