"""Which CPUs the served-against-offline benchmark gives to whom: the engine (the server's engine process, and the
offline `LLM` in the benchmark's own process) gets the first allowed CPUs to itself, one per torch thread; the HTTP
server and the load generator share the others, as a client on another machine and a front end beside the engine
would. Left to the OS on a two-core machine, the load generator and the HTTP server run on the engine's core part of
the time, and the served run pays for the client's work as well as for serving. Linux only (`sched_setaffinity`,
/proc); with no CPU left beside the engine's, or no /proc, nothing is pinned and the reason is given instead.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvlab.bench")
Runner = Callable[[], float]       # one timed run, returning its seconds
SERVE_ARGV = b"kvlab.experiments.cli.main\0serve\0"   # how experiments/serve/process.py starts a server


@dataclass(frozen=True, slots=True)
class CoreSplit:
    engine: frozenset[int]          # the engine process, and the offline engine
    front: frozenset[int]           # the HTTP server and the load generator
    everything: frozenset[int]      # what this process was allowed at the start

    def describe(self) -> str:
        return f"engine on CPU {_cpus(self.engine)}, HTTP server and load generator on CPU {_cpus(self.front)}"


def core_split(engine_threads: int = 1) -> tuple[CoreSplit | None, str]:
    """The split (the engine's torch threads get a CPU each), or None and why not."""
    if not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir():
        return None, "not pinned: no sched_setaffinity or /proc here"
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) <= engine_threads:
        return None, (f"not pinned: this process may use {len(allowed)} CPU(s), none left beside the engine's "
                      f"{engine_threads} thread(s)")
    engine = frozenset(sorted(allowed)[:engine_threads])
    split = CoreSplit(engine, allowed - engine, allowed)
    return split, split.describe()


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of `pid` (threads it starts later inherit their creator's CPUs)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, FileNotFoundError):   # a thread that ended meanwhile
            pass


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return kids


def pin_servers(split: CoreSplit, engine_thread: bool = False) -> int:
    """Pin each `kvlab serve` this process started: the server to the front CPUs, its engine process (every
    descendant) to the engine's; with `engine_thread` the server holds the engine and goes to the engine's CPUs.
    Returns how many servers were pinned."""
    servers = [pid for pid in children(os.getpid()) if SERVE_ARGV in Path(f"/proc/{pid}/cmdline").read_bytes()]
    for server in servers:
        pin_process(server, split.engine if engine_thread else split.front)
        stack = children(server)
        while stack:
            pid = stack.pop()
            pin_process(pid, split.engine)
            stack += children(pid)
    return len(servers)


def placed(offline: Runner, served: Runner, engine_threads: int, engine_thread: bool) -> tuple[Runner, Runner, str]:
    """The two runs with their CPUs (this process's `kvlab serve` pinned now), and where they run; unpinned runs,
    the reason logged, when there is no split or no server to pin."""
    split, placement = core_split(engine_threads)
    if split is not None and pin_servers(split, engine_thread) != 1:
        split, placement = None, "not pinned: the benchmark's server was not found among this process's children"
    if split is None:
        log.warning("serving bench: %s", placement)
        return offline, served, placement
    return (on_cpus(offline, split.engine, split.everything), on_cpus(served, split.front, split.everything),
            placement)


def on_cpus(fn: Runner, cpus: frozenset[int], everything: frozenset[int]) -> Runner:
    """`fn` run with this whole process on `cpus`, then back on `everything`."""
    def run() -> float:
        pin_process(os.getpid(), cpus)
        try:
            return fn()
        finally:
            pin_process(os.getpid(), everything)
    return run


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
