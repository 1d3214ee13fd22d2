"""Pool members in other processes, for the pool's process tests: `RemoteMember` runs one engine in a subprocess
(worker_main), driven by JSON lines on its stdin; every read has a deadline and every worker exits when its stdin
closes. Also the books as they stand and what of a pool is left on the machine."""
from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
from pathlib import Path

from fakes.page_window import PageWindow

from kvlab.vmm import pool
from kvlab.vmm.pool.status import PoolStatus, read_status

TESTS = Path(__file__).resolve().parents[1]
PAGE = 4096
CALL_TIMEOUT_S = 60.0


# -- the worker (runs in the subprocess) -------------------------------------------------------------------------------
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
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from helpers.pool_workers import worker_main; " \
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


def books(member: pool.PoolMember) -> PoolStatus:
    """The books as they stand, without returning dead engines' pages first (that is the steward's job here)."""
    with member._attachment.locked() as ledger:
        return read_status(member.name, ledger)


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
