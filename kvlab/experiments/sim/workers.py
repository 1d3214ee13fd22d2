"""The simulator's worker processes: a pool whose workers leave Ctrl-C to the parent and die with it, and whose
parent stops waiting when a worker dies (multiprocessing's pool replaces a dead worker but loses its task: the wait
for that result would never end), and when the pool's own terminate hangs (`_stop`)."""
from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from kvlab.common.errors import KvlabError

STRAGGLER_WAIT_S = 2.0   # after the pool's own terminate, how long a child may take to go before it is killed
TERMINATE_WAIT_S = 5.0   # how long the pool's own terminate may take before the parent stops waiting for it
POLL_S = 0.5             # how often a wait for results looks at the workers


class WorkerDied(KvlabError):
    """A worker process ended while the pool was working: the task it held is lost."""


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which terminates them (no KeyboardInterrupt trace per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class LivePool:
    """The pool's calls the simulator makes (imap, imap_unordered, apply_async), with every wait for results
    broken off every POLL_S to look at the workers: one that ended (killed, out of memory) raises WorkerDied."""

    def __init__(self, pool: Any, workers: list[Any]) -> None:
        self.pool, self.workers = pool, workers

    def check(self) -> None:
        """Raise WorkerDied if a worker has ended (call while waiting: workers end only when the pool does)."""
        for worker in self.workers:
            if worker.exitcode is not None:
                raise WorkerDied(f"simulator worker {worker.pid} ended ({_how(worker.exitcode)}) while it held a "
                                 "run; that run is lost and the pool is stopped")

    def map(self, fn: Callable[[Any], Any], args: Iterable[Any]) -> list[Any]:
        return list(self.imap(fn, args))

    def imap(self, fn: Callable[[Any], Any], args: Iterable[Any]) -> Iterator[Any]:
        return self._watched(self.pool.imap(fn, args))

    def imap_unordered(self, fn: Callable[[Any], Any], args: Iterable[Any]) -> Iterator[Any]:
        return self._watched(self.pool.imap_unordered(fn, args))

    def apply_async(self, *args: Any, **kwargs: Any) -> Any:
        return self.pool.apply_async(*args, **kwargs)

    def _watched(self, results: Any) -> Iterator[Any]:
        while True:
            try:
                yield results.next(POLL_S)
            except StopIteration:
                return
            except multiprocessing.TimeoutError:
                self.check()


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


@contextmanager
def worker_pool(processes: int) -> Iterator[LivePool]:
    """A process pool whose workers are terminated, not awaited, when the parent is interrupted or fails: a
    Ctrl-C stops every worker at once and leaves no orphan behind.

    The workers fork with SIGINT held: a Ctrl-C that arrived during a fork would be raised inside an at-fork hook,
    where Python drops it (the command then ran on). It is raised once the pool exists, inside the block that
    terminates it, so no moment is left where the pool is made and not yet in anyone's hands."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        others = set(multiprocessing.active_children())
        pool = multiprocessing.get_context().Pool(processes, initializer=_ignore_sigint)
        workers = [child for child in multiprocessing.active_children() if child not in others]
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)   # a Ctrl-C held while the workers forked: raised here
        yield LivePool(pool, workers)
        pool.close()
    except BaseException:
        _stop(pool)
        raise
    pool.join()


def _stop(pool: Any) -> None:
    """Terminate the pool, waiting at most TERMINATE_WAIT_S; kill any child left; join the pool unless its own
    terminate is still stuck, which nobody then waits for. It can wait forever: a worker it kills while that worker
    sends a result holds the result queue's write lock for good, and the pool's task handler, which sends that
    queue a last message, then blocks on the lock (CPython's multiprocessing.Pool). The pool's threads are
    daemons, so a stuck one does not keep the process alive."""
    stopping = threading.Thread(target=pool.terminate, name="kvlab-pool-terminate", daemon=True)
    stopping.start()
    stopping.join(TERMINATE_WAIT_S)
    _kill_stragglers()
    if not stopping.is_alive():
        pool.join()


def _kill_stragglers() -> None:
    """Any child still alive after the pool's terminate (the pool waits only for the workers it lists) is killed."""
    for child in multiprocessing.active_children():
        child.join(STRAGGLER_WAIT_S)
        if child.is_alive():
            child.kill()
            child.join(STRAGGLER_WAIT_S)
