"""The simulator's worker processes: a pool whose workers leave Ctrl-C to the parent and die with it."""
from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STRAGGLER_WAIT_S = 2.0   # after the pool's own terminate, how long a child may take to go before it is killed


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which terminates them (no KeyboardInterrupt trace per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def worker_pool(processes: int) -> Iterator[Any]:
    """A process pool whose workers are terminated, not awaited, when the parent is interrupted or fails: a
    Ctrl-C stops every worker at once and leaves no orphan behind.

    The workers fork with SIGINT held: a Ctrl-C that arrived during a fork would be raised inside an at-fork hook,
    where Python drops it (the command then ran on). It is raised once the pool exists, inside the block that
    terminates it, so no moment is left where the pool is made and not yet in anyone's hands."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = multiprocessing.get_context().Pool(processes, initializer=_ignore_sigint)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)   # a Ctrl-C held while the workers forked: raised here
        yield pool
        pool.close()
    except BaseException:
        pool.terminate()
        _kill_stragglers()
        raise
    finally:
        pool.join()


def _kill_stragglers() -> None:
    """Any child still alive after the pool's terminate (the pool waits only for the workers it lists) is killed."""
    for child in multiprocessing.active_children():
        child.join(STRAGGLER_WAIT_S)
        if child.is_alive():
            child.kill()
            child.join(STRAGGLER_WAIT_S)
