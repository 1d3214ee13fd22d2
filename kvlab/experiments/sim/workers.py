"""The simulator's worker processes: a pool whose workers leave Ctrl-C to the parent and die with it."""
from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which terminates them (no KeyboardInterrupt trace per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def worker_pool(processes: int) -> Iterator[Any]:
    """A process pool whose workers are terminated, not awaited, when the parent is interrupted or fails: a
    Ctrl-C stops every worker at once and leaves no orphan behind."""
    pool = _start_pool(processes)
    try:
        yield pool
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _start_pool(processes: int) -> Any:
    """Fork the workers with SIGINT held: a Ctrl-C that arrived during a fork would be raised inside an at-fork
    hook, where Python drops it (the command then ran on). Held, it is raised here once the workers exist."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return multiprocessing.get_context().Pool(processes, initializer=_ignore_sigint)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
