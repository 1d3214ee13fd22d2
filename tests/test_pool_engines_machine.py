"""Two vmm engines on one shared pool under a hypothesis state machine (issue 29): random admits, steps, frees,
forks, swaps and preemptions on both, and each engine's floor and ceiling changed mid-run. The pool is smaller
than the two budgets together, so takes are refused and idle pages move between the engines (their stewards
answer the ledger's `wanted` on their own threads, as in a server). After every step each engine passes the
checks of tests/helpers/invariants.py (its books, and its K/V read back through the pool memfd at the pages the books
give it), the books say each engine holds exactly the pool pages its driver backs, the kernel maps into its
ranges exactly those (check_pool), and the two engines' pages never overlap: neither can see the other's data.

A second variant runs the other engine in its own process (tests/helpers/invariants.py's random workload, every check
after every operation) while the machine drives this one. A mixed pool (issue 38) runs a vmm and an elastic engine
(paged blocks over chunks mapped on demand) through the same rules and checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
import pytest
from helpers.invariants import MAX_LEN, OPS, PAGE, VOCAB, Workload, check_pool_books, one_torch_thread  # noqa: F401
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvlab.vmm import pool
from kvlab.vmm.drivers import pooled

ENGINE_PAGES = 32          # the vmm probe's budget: 8 page groups x 4 tensors
TOTAL = 24                 # pages: less than either budget, so takes are refused
ENGINES = (0, 1)
PICK_BOUND = 63            # a drawn index, taken modulo the candidates (far fewer)
TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def short_waits(monkeypatch):
    """A refused engine waits for the others' answer 0.5 s in a server; the machine refuses often."""
    monkeypatch.setattr(pooled, "ANSWER_WAIT_S", 0.02)


def pool_name() -> str:
    return f"machine-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class TwoEngines(RuleBasedStateMachine):
    kinds: tuple[str, str] = ("vmm", "vmm")       # each engine's backend: both map pages of PAGE bytes
    overrides: dict = {}
    backend_overrides: dict[str, dict] = {}       # options for one backend's engines only
    totals: Counter = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.holder = pool.create(pool_name(), TOTAL * PAGE, PAGE, engine="holder", ceiling=0)
        self.w = [Workload(self.kinds[who], False, seed=who, kv_pool=self.holder.name, check_invariants=True,
                           **self.overrides, **self.backend_overrides.get(self.kinds[who], {})) for who in ENGINES]
        self.limits = {who: (0, TOTAL) for who in ENGINES}

    def engine(self, who: int) -> str:
        return self.w[who].cache.driver.member.engine

    def pick(self, data, state: str) -> tuple[Workload | None, int | None]:
        """An engine with sequences in `state`, and one of them (None, None: no engine has any). Which sequences
        are in a state depends on the stewards' threads (a refused admission waits), and hypothesis must see the
        same draws and the same rules when it replays a case (else FlakyStrategyDefinition): so no rule has a
        precondition on them, and this draws two indices with fixed bounds whatever the state."""
        engine, index = data.draw(st.integers(0, len(ENGINES) - 1)), data.draw(st.integers(0, PICK_BOUND))
        ws = [w for w in self.w if w.ids(state)]
        if not ws:
            return None, None
        w = ws[engine % len(ws)]
        ids = w.ids(state)
        return w, ids[index % len(ids)]

    prompts = st.lists(st.integers(3, VOCAB), min_size=1, max_size=MAX_LEN - 1)

    def who(self, data) -> int:
        return data.draw(st.sampled_from(range(len(self.w))))

    @rule(data=st.data(), prompt=prompts, max_tokens=st.integers(1, 48), chunk=st.integers(1, MAX_LEN))
    def admit(self, data, prompt, max_tokens, chunk):
        self.w[self.who(data)].admit(prompt, max_tokens, chunk)

    @rule(data=st.data(), chunk=st.integers(1, MAX_LEN))
    def readmit(self, data, chunk):
        w, sid = self.pick(data, "waiting")
        if w is not None:
            w.readmit(sid, chunk)

    @rule(data=st.data(), n=st.integers(1, 24))
    def step(self, data, n):
        """One engine's step: up to three picked sequences compute up to n tokens each (1: a decode step)."""
        w, _ = self.pick(data, "live")
        drawn = data.draw(st.lists(st.integers(0, PICK_BOUND), min_size=1, max_size=3))
        if w is not None:
            live = w.ids("live")
            w.write([(sid, n) for sid in dict.fromkeys(live[i % len(live)] for i in drawn)])

    @rule(data=st.data(), n=st.integers(1, 24))
    def grow(self, data, n):
        w, sid = self.pick(data, "live")
        if w is not None:
            w.grow(sid, n)

    @rule(data=st.data())
    def fork(self, data):
        w, sid = self.pick(data, "live")
        if w is not None:
            w.fork(sid)

    @rule(data=st.data())
    def free(self, data):
        w, sid = self.pick(data, "live")
        if w is not None:
            w.free(sid)

    @rule(data=st.data())
    def preempt(self, data):
        w, sid = self.pick(data, "live")
        if w is not None:
            w.preempt(sid)

    @rule(data=st.data())
    def swap_out(self, data):
        w, sid = self.pick(data, "live")
        if w is not None and w.seq(sid).num_computed_tokens:
            w.swap_out(sid)

    @rule(data=st.data())
    def swap_in(self, data):
        w, sid = self.pick(data, "swapped")
        if w is not None:
            w.swap_in(sid)

    @rule(data=st.data(), floor=st.integers(0, TOTAL // 2), room=st.integers(0, TOTAL))
    def limit(self, data, floor, room):
        """A new floor and ceiling for a running engine (kvlab pool limit): takes obey them from the next call."""
        who = self.who(data)
        ceiling = min(TOTAL, floor + room)
        pool.set_limits(self.holder.name, self.engine(who), floor * PAGE, ceiling * PAGE)
        self.limits[who] = (floor, ceiling)
        type(self).totals["limit"] += 1

    @rule(data=st.data(), n=st.integers(1, 8))
    def answer(self, data, n):
        """The steward's call, made now: give up to n spare pages back (freed slots' pages first, then idle
        prefix-cache pages), never below the engine's floor."""
        who = self.who(data)
        cache = self.w[who].cache
        floor = self.limits[who][0]
        held = cache.driver.member.record().held
        cache.give_back(n)
        type(self).totals["answer"] += 1
        assert cache.driver.member.record().held >= min(held, floor), "an engine gave back below its floor"

    @invariant()
    def engines_and_books_agree(self):
        for w in self.w:
            w.check()                   # its books, its K/V through the pool memfd, check_pool
        status = self.holder.status()
        check_pool_books(status)
        owned = [set(w.cache.driver.member.owned()) for w in self.w]
        assert not owned[0] & owned[1], "two engines hold one pool page"
        for who in ENGINES:
            e = status.engine(self.engine(who))
            assert (e.floor, e.ceiling) == self.limits[who]

    def teardown(self):
        try:
            for w in reversed(self.w):      # the later engine's threads and mappings are not in the earlier's baseline
                extra = w.cache.stats().extra          # cached groups (vmm) or chunks (elastic) given, by this rule
                type(self).totals["evicted"] += extra.get("evicted_for_pool", 0)       # or a steward
                type(self).totals["chunks_given"] += extra.get("chunks_given", 0)
                type(self).totals["compaction_moves"] += extra.get("compaction_moves", 0)
                type(self).totals[f"{w.backend} ops"] += w.num_ops
                type(self).totals[f"{w.backend} refused"] += w.ops["refused"]
                w.drain()
                type(self).totals.update(w.ops)
            assert self.holder.status().used == 0, "the engines left pages in the pool"
        finally:
            for w in self.w:
                w.kv.close()
            self.holder.close()


def run(machine: type, examples: int) -> None:
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck), print_blob=False))


def test_two_engines_on_one_pool_keep_their_books_and_their_data(capsys):
    machine = type("TwoEnginesMachine", (TwoEngines,), {"totals": Counter()})
    run(machine, 30)
    t = machine.totals
    total = sum(t[k] for k in OPS + ("limit", "answer"))
    with capsys.disabled():
        print(f"\n[pool machine] two engines: {total} operations ({t['limit']} limit changes, {t['answer']} "
              f"give-backs), {t['refused']} refused")
    assert total >= 500 and t["refused"] > 0 and t["limit"] and t["answer"]     # the pool was short and said so


SHARED = [list(range(10, 18)), list(range(40, 53)), list(range(100, 120)), list(range(200, 240)),
          list(range(300, 333))]          # prefixes of 1-2 whole 16-token pages: admissions hit the cache


class TwoCachingEngines(TwoEngines):
    """Both engines cache prefixes: idle cached pages are kept (never a spare) until evicted, and a give-back
    evicts them, whole page groups, within the floor."""
    overrides = {"enable_prefix_caching": True}

    @rule(data=st.data(), prompt=st.tuples(st.sampled_from(SHARED), st.lists(st.integers(3, VOCAB), max_size=20)),
          max_tokens=st.integers(1, 24), chunk=st.integers(1, MAX_LEN))
    def admit_shared(self, data, prompt, max_tokens, chunk):
        self.w[self.who(data)].admit((prompt[0] + prompt[1])[:MAX_LEN - 1], max_tokens, chunk)


def test_two_engines_caching_prefixes_on_one_pool_keep_their_books_and_their_data(capsys):
    """How often a cached group is still idle when a give-back comes depends on the stewards' threads, so the
    machine's evictions are reported, not required: the test below takes that path on purpose."""
    machine = type("TwoCachingEnginesMachine", (TwoCachingEngines,), {"totals": Counter()})
    t = machine.totals
    for _ in range(3):      # run again (every check still runs after every step) until a hit and a refusal happened
        run(machine, 20)
        if t["prefix_hit_tokens"] and t["refused"]:
            break
    with capsys.disabled():
        print(f"\n[pool machine] two caching engines: {sum(t[k] for k in OPS)} operations, "
              f"{t['prefix_hit_tokens']} prefix-hit tokens, {t['answer']} give-backs, {t['evicted']} cached groups "
              f"evicted for the pool, {t['refused']} refused")
    assert t["prefix_hit_tokens"] > 0 and t["refused"] > 0


def test_a_give_back_evicts_idle_cached_groups_above_the_floor():
    """An engine whose pages are idle in its prefix cache answers a give-back by evicting whole cached groups
    (never below its floor), and the pool gets their pages."""
    with pool.create(pool_name(), TOTAL * PAGE, PAGE, engine="holder", ceiling=0) as holder:
        w = Workload("vmm", False, kv_pool=holder.name, check_invariants=True, enable_prefix_caching=True)
        try:
            w.admit(SHARED[3], 1, MAX_LEN)           # 40 tokens: two whole 16-token groups cached
            w.write([(sid, 1) for sid in w.ids("live")])
            for sid in w.ids("live"):
                w.free(sid)
            w.check()
            cache = w.cache
            assert cache.stats().extra["prefix_idle_pages"] == 2   # groups
            pool.set_limits(holder.name, w.cache.driver.member.engine, 4 * PAGE, TOTAL * PAGE)
            cache.give_back(TOTAL)
            w.check()
            stats = cache.stats().extra
            assert stats["evicted_for_pool"] >= 1 and cache.driver.member.record().held >= 4
            assert holder.status().used == cache.driver.member.record().held
        finally:
            w.drain()
            w.kv.close()


# -- a mixed pool: a vmm and an elastic engine (issue 38) ----------------------------------------------------------
# Both map 4 KiB pages; the elastic engine maps a chunk (one page in each of its 4 planes) at a time and answers
# asks by forgetting the cached blocks of whole chunks. The tabled example counts run scaled by DEFAULT (the
# default suite) or in full (-m slow), as tests/test_properties.py's machines do.
DEFAULT, LONG = 0.3, 3


class VmmAndElastic(TwoEngines):
    """The elastic engine compacts (elastic_compact 0): blocks move, and chunks unmap, after its frees."""
    kinds = ("vmm", "elastic")
    backend_overrides = {"elastic": {"elastic_compact": 0}}


class VmmAndElasticCaching(TwoCachingEngines):
    kinds = ("vmm", "elastic")


MIXED = ((VmmAndElastic, 20), (VmmAndElasticCaching, 10))      # (machine, tabled examples)


def run_mixed(machines: tuple, scale: float, capsys) -> Counter:
    totals = Counter()
    for machine, examples in machines:
        run(type(machine.__name__ + "Machine", (machine,), {"totals": totals}), max(2, round(examples * scale)))
    with capsys.disabled():
        print(f"\n[pool machine] vmm + elastic: {sum(totals[k] for k in OPS)} operations ({totals['limit']} limit "
              f"changes, {totals['answer']} give-backs, {totals['chunks_given']} elastic chunks given, "
              f"{totals['prefix_hit_tokens']} prefix-hit tokens), {totals['refused']} refused; elastic "
              f"{totals['elastic ops']} operations, {totals['elastic refused']} refused, "
              f"{totals['compaction_moves']} blocks moved")
    return totals


def test_a_vmm_and_an_elastic_engine_on_one_pool_keep_their_books_and_their_data(capsys):
    """The default suite's representative: the machine without prefix caching (about 2 s on an idle machine)."""
    t = run_mixed(MIXED[:1], DEFAULT, capsys)
    # every operation's books and data are checked inside the machine; here only that both engines worked. How
    # many draws act, and whether the pool ran short, depends on the pool's threads: 63 operations (30 elastic, 4
    # refused) alone, 45 (15 elastic, 4 or 0 refused) inside the parallel suite. Refusals are the slow run's to show.
    assert sum(t[k] for k in OPS) >= 30 and t["elastic ops"] >= 8 and sum(t[k] for k in OPS) > t["elastic ops"]


@pytest.mark.slow     # ~35 s (load 7): both machines, prefix caching included, 3x their tabled examples
def test_a_vmm_and_an_elastic_engine_on_one_pool_long(capsys):
    t = run_mixed(MIXED, LONG, capsys)
    # Whether an ask lands while the elastic engine has a whole idle chunk depends on the pool's threads: 1 chunk
    # given alone (the same before and after 1d57d21), 0 once beside the rest of the slow suite. So the chunks are
    # only reported here; tests/test_elastic_pool.py gives them deterministically.
    assert sum(t[k] for k in OPS) >= 1000 and t["elastic refused"] > 0 and t["prefix_hit_tokens"] and t["answer"]


# -- the other engine in another process --------------------------------------------------------------------------
REMOTE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from helpers.invariants import random_workload
from kvlab.vmm.drivers import pooled
pooled.ANSWER_WAIT_S = 0.02
ops = random_workload("vmm", False, int(sys.argv[3]), int(sys.argv[4]), kv_pool=sys.argv[2], check_invariants=True)
print(json.dumps(dict(ops)), flush=True)
"""


class OneEngineBesideAnother(TwoEngines):
    """The second engine runs in the process `remote`; the rules drive this one."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.holder = pool.create(pool_name(), TOTAL * PAGE, PAGE, engine="holder", ceiling=0)
        self.remote = subprocess.Popen([sys.executable, "-c", REMOTE, str(TESTS), self.holder.name, "7", "120"],
                                       stdout=subprocess.PIPE, text=True)
        self.w = [Workload("vmm", False, seed=0, kv_pool=self.holder.name, check_invariants=True, **self.overrides)]
        self.limits = {0: (0, TOTAL)}
        deadline = time.monotonic() + 120
        while len(self.holder.status().engines) < 3:    # the rules start once the other engine runs too
            assert time.monotonic() < deadline and self.remote.poll() is None, "the other engine did not join"
            time.sleep(0.05)

    @invariant()
    def engines_and_books_agree(self):
        self.w[0].check()
        status = self.holder.status()
        check_pool_books(status)

    def teardown(self):
        try:
            out, _ = self.remote.communicate(timeout=300)
            assert self.remote.returncode == 0, "the engine in the other process failed its checks"
            type(self).totals["remote_ops"] += sum(json.loads(out).get(k, 0) for k in OPS)
        finally:
            self.remote.kill()
            super().teardown()


@pytest.mark.slow     # ~15 s; tests/test_pool_engine.py and test_elastic_real_pool.py run engines in two processes
def test_an_engine_beside_one_in_another_process_keeps_its_books_and_data(capsys):
    machine = type("RemoteMachine", (OneEngineBesideAnother,), {"totals": Counter()})
    run(machine, 2)
    with capsys.disabled():
        print(f"\n[pool machine] here {sum(machine.totals[k] for k in OPS)} operations, in the other process "
              f"{machine.totals['remote_ops']}")
    assert machine.totals["remote_ops"] >= 2 * 120 * 0.5
