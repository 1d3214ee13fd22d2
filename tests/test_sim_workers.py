"""The simulator's worker pool (kvlab/experiments/sim/workers.py): a Ctrl-C that arrives while its workers fork is
raised once the pool exists, inside the block that terminates it: no worker is left behind."""
from __future__ import annotations

import multiprocessing
import os
import signal

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
