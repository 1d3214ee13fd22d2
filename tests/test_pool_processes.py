"""The pool across processes (issue 29): engines in separate processes take and give pages against a nearly full
pool, each writing its pid into its pages through a MAP_FIXED mapping and checking them, while members are
killed -9 and limits change. `RemoteMember` runs one engine in a subprocess (worker_main), driven by JSON lines
on its stdin; every read has a deadline, every worker exits when its stdin closes, and every test kills what it
started."""
from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes.page_window import PageWindow

from kvlab.vmm import pool
from kvlab.vmm.pool.status import PoolStatus, read_status

TESTS = Path(__file__).resolve().parent
PAGE = 4096
REAP_BOUND_S = 3.0        # two steward intervals (0.2 s) with room for a loaded 2-core machine
CALL_TIMEOUT_S = 60.0


# -- the worker (runs in the subprocess) ------------------------------------------------------------------------
class Engine:
    """A pool member that maps every page it takes at window slot = page id and keeps its pid in it."""

    def __init__(self, member: pool.PoolMember) -> None:
        self.member, self.stamp = member, os.getpid().to_bytes(8, "little")
        self.window = PageWindow(member.page_size, member.total_pages)

    def take(self, n: int) -> list[int] | None:
        pages = self.member.take(n)
        for page in pages or []:
            self.window.map(page, self.member.page_fd, self.member.page_offset(page))
            view = self.window.view(page)
            assert not any(view[:8]) and not any(view[-8:]), f"page {page} came with another engine's data"
            view[:8] = view[-8:] = self.stamp
        return pages

    def check(self, pages: list[int]) -> None:
        for page in pages:
            view = self.window.view(page)
            assert view[:8] == self.stamp and view[-8:] == self.stamp, f"page {page} was written by another"

    def give(self, pages: list[int]) -> None:
        self.check(pages)
        for page in pages:
            self.window.unmap(page)
        self.member.give(pages)

    def race(self, ops: int, seed: int, most: int, take_share: float) -> dict:
        rng, refused = random.Random(seed), 0
        for _ in range(ops):
            held = sorted(self.member.held)
            if not held or rng.random() < take_share:
                refused += self.take(rng.randint(1, most)) is None
            else:
                self.give(rng.sample(held, rng.randint(1, len(held))))
        self.check(sorted(self.member.held))
        return {"refused": refused, "held": sorted(self.member.held)}

    def die_inside_a_change(self) -> None:
        """SIGKILL itself while holding the pool lock, halfway through marking free pages as its own."""
        attachment = self.member._attachment
        with attachment.locked() as ledger, ledger.changing():
            free = ledger.owner == -1
            ledger.owner[free.nonzero()[0][:3]] = self.member.index
            os.kill(os.getpid(), signal.SIGKILL)


def serve(engine: Engine, request: dict) -> object:
    op = request.pop("op")
    if op == "take":
        return engine.take(request["n"])
    if op == "give":
        return engine.give(request["pages"])
    if op == "check":
        engine.check(sorted(engine.member.held))
        return sorted(engine.member.held)
    if op == "race":
        return engine.race(**request)
    if op == "die_inside_a_change":
        return engine.die_inside_a_change()
    raise ValueError(f"unknown op {op}")


def worker_main() -> None:
    name, engine_name, create_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    signal.alarm(int(sys.argv[4]))          # bounded even if the test forgets it
    member = (pool.create(name, create_bytes, PAGE, engine=engine_name) if create_bytes
              else pool.join(name, engine=engine_name))
    engine = Engine(member)
    print(json.dumps({"ok": [os.getpid(), member.index]}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        try:
            print(json.dumps({"ok": serve(engine, request)}), flush=True)
        except Exception as e:   # the test reads the failure, then the worker goes on
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    member.close()


# -- the test side ----------------------------------------------------------------------------------------------
class WorkerError(AssertionError):
    pass


class RemoteMember:
    """An engine in its own process; `create_bytes` makes it the pool's creator."""

    def __init__(self, name: str, engine: str, create_bytes: int = 0, lifetime_s: int = 300) -> None:
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_pool_processes import worker_main; " \
               "worker_main()"
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, "-c", code, name, engine, str(create_bytes), str(lifetime_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid, self.slot = self.read()

    def read(self, timeout: float = CALL_TIMEOUT_S) -> object:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise WorkerError(f"worker {self.engine} gave no answer (exit code {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"worker {self.engine}: {reply['error']}")
        return reply["ok"]

    def send(self, op: str, **args: object) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args: object) -> object:
        self.send(op, **args)
        return self.read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


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


def books(member: pool.PoolMember) -> PoolStatus:
    """The books as they stand, without returning dead engines' pages first (that is the steward's job here)."""
    with member._attachment.locked() as ledger:
        return read_status(member.name, ledger)


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


def leftovers(name: str) -> list[str]:
    """Anything of pool `name` on the machine: descriptors or mappings in any process, /dev/shm, the socket."""
    tag = f"kvlab-pool-{name}"
    found = [p.name for p in Path("/dev/shm").glob("*") if name in p.name]
    found += [line for line in Path("/proc/net/unix").read_text().splitlines() if tag in line]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            found += [f"{proc.name}: {line}" for line in (proc / "maps").read_text().splitlines() if tag in line]
            found += [f"{proc.name}: fd {fd.name}" for fd in (proc / "fd").iterdir() if tag in os.readlink(fd)]
        except OSError:       # a process that ended meanwhile, or one not ours
            continue
    return found


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
