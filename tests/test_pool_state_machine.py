"""A hypothesis state machine over take / give / limit / kill -9 with two engines in their own processes, checked
against a model of the pool: every take succeeds exactly when the ceiling and the other engine's unmet floor allow,
the books equal the model after every step, and each engine's pages still hold its pid."""
from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from helpers.pool_workers import PAGE, RemoteMember, books
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvlab.vmm import pool

TOTAL = 12
ENGINES = (0, 1)


class Engines:
    """The pool (held by this process, which takes nothing) and two engine processes, replaced when killed."""

    def __init__(self) -> None:
        self.name = f"test-machine-{os.getpid()}"
        self.holder = pool.create(self.name, TOTAL * PAGE, PAGE, engine="holder", ceiling=0)
        self.generation = 0
        self.workers = [self.spawn(who) for who in ENGINES]

    def spawn(self, who: int) -> RemoteMember:
        self.generation += 1
        return RemoteMember(self.name, f"m{who}-{self.generation}")

    def replace(self, who: int) -> None:
        """kill -9, then the next look at the books returns its pages (pool.status reaps)."""
        dead = self.workers[who]
        dead.kill()
        assert pool.status(self.name).engine(dead.engine) is None
        self.workers[who] = self.spawn(who)

    def reset(self) -> None:
        for w in self.workers:
            pool.set_limits(self.name, w.engine, 0, TOTAL * PAGE)
            held = w.call("check")
            if held:
                w.call("give", pages=held)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.holder.close()


class PoolMachine(RuleBasedStateMachine):
    engines: Engines

    def __init__(self) -> None:
        super().__init__()
        self.engines.reset()
        self.held: dict[int, set[int]] = {who: set() for who in ENGINES}
        self.limits = {who: (0, TOTAL) for who in ENGINES}
        self.kills = 0

    def unmet_floor(self, who: int) -> int:
        return max(0, self.limits[who][0] - len(self.held[who]))

    def free(self) -> int:
        return TOTAL - sum(len(h) for h in self.held.values())

    @rule(who=st.sampled_from(ENGINES), n=st.integers(1, TOTAL))
    def take(self, who: int, n: int) -> None:
        allowed = (len(self.held[who]) + n <= self.limits[who][1]
                   and self.free() - n >= self.unmet_floor(1 - who))
        got = self.engines.workers[who].call("take", n=n)
        assert (got is not None) == allowed, (who, n, self.held, self.limits)
        if got:
            assert len(got) == n and not set(got) & (self.held[0] | self.held[1])
            self.held[who].update(got)

    @precondition(lambda self: self.held[0] or self.held[1])
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        who = data.draw(st.sampled_from([w for w in ENGINES if self.held[w]]))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[who])), min_size=1, unique=True))
        self.engines.workers[who].call("give", pages=pages)
        self.held[who].difference_update(pages)

    @rule(who=st.sampled_from(ENGINES), floor=st.integers(0, TOTAL), ceiling=st.integers(0, TOTAL))
    def limit(self, who: int, floor: int, ceiling: int) -> None:
        fits = floor <= ceiling and floor + self.limits[1 - who][0] <= TOTAL
        try:
            pool.set_limits(self.engines.name, self.engines.workers[who].engine, floor * PAGE, ceiling * PAGE)
        except pool.LimitError:
            assert not fits
            return
        assert fits
        self.limits[who] = (floor, ceiling)

    @precondition(lambda self: self.kills < 1)       # a new engine process costs a start-up
    @rule(who=st.sampled_from(ENGINES))
    def kill(self, who: int) -> None:
        self.engines.replace(who)
        self.held[who] = set()
        self.limits[who] = (0, TOTAL)
        self.kills += 1

    @invariant()
    def books_equal_the_model(self) -> None:
        s = books(self.engines.holder)
        assert s.free == self.free() and len(s.engines) == 3
        for who, w in enumerate(self.engines.workers):
            e = s.engine(w.engine)
            assert (e.held, e.floor, e.ceiling) == (len(self.held[who]), *self.limits[who])
            assert set(w.call("check")) == self.held[who]       # and its pages still hold its pid


@pytest.fixture
def engines():
    engines = Engines()
    yield engines
    engines.close()


def test_pool_state_machine(engines):
    machine = type("Machine", (PoolMachine,), {"engines": engines})
    run_state_machine_as_test(machine, settings=settings(max_examples=12, stateful_step_count=15, deadline=None,
                                                         suppress_health_check=list(HealthCheck)))
