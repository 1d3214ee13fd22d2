"""The simulator's worker pool (kvlab/experiments/sim/workers.py): a Ctrl-C that arrives while its workers fork is
raised once the pool exists, inside the block that terminates it: no worker is left behind; and a worker killed
mid-task ends the wait for its result instead of hanging it."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from kvlab.experiments.sim import workers


def test_a_ctrl_c_held_while_the_workers_fork_terminates_them(monkeypatch):
    real = multiprocessing.get_context()

    class InterruptedWhileForking:
        def Pool(self, *args, **kwargs):       # noqa: N802 - multiprocessing's name
            pool = real.Pool(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)   # held: SIGINT is blocked while the pool starts
            return pool

    monkeypatch.setattr(workers.multiprocessing, "get_context", lambda: InterruptedWhileForking())
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with workers.worker_pool(2):
            ran.append(True)
    assert not ran, "the block ran although the interrupt came first"
    assert multiprocessing.active_children() == [], "a worker outlived the interrupted pool"


def test_the_pool_runs_work_and_leaves_no_child():
    with workers.worker_pool(2) as pool:
        assert sorted(pool.map(abs, [-2, -1, 3])) == [1, 2, 3]
    assert multiprocessing.active_children() == []


def _die_on(x: int) -> int:
    """A job whose worker is killed (as the kernel's OOM killer would) when it gets 0."""
    if x == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


@pytest.mark.parametrize("call", ["imap", "imap_unordered"])
def test_a_worker_killed_mid_task_stops_the_wait_instead_of_hanging(call):
    """multiprocessing's pool replaces a killed worker and loses its task: a plain wait for its result never ends.
    The pool's waits look at the workers and raise, naming the worker and its signal; no child is left."""
    started = time.monotonic()
    with pytest.raises(workers.WorkerDied, match=r"simulator worker \d+ ended \(killed by SIGKILL\)"):
        with workers.worker_pool(2) as pool:
            list(getattr(pool, call)(_die_on, [3, 0, 5, 7]))
    assert time.monotonic() - started < 30
    assert multiprocessing.active_children() == []


def test_the_search_pool_stops_when_a_worker_dies():
    """The SLO searches' driver (apply_async and its own wait) raises the same way."""
    from kvlab.experiments.sim.serve import search_pool

    def steps():
        yield 0
        return 0

    search = search_pool.Search(job=("die",), steps=steps(), point_args=lambda x: x, summary=lambda r: {"r": r})
    with pytest.raises(workers.WorkerDied, match="killed by SIGKILL"):
        search_pool.run_searches(_die_on, [search], lambda found: [], total=1, jobs=2)
    assert multiprocessing.active_children() == []
