"""The simulator's worker pool (kvlab/experiments/sim/workers.py): a Ctrl-C that arrives while its workers fork is
raised once the pool exists, inside the block that terminates it: no worker is left behind; and a worker killed
mid-task ends the wait for its result instead of hanging it; a pool terminate stuck on a worker's lock does not
hold up the block's own error."""
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


STUCK_TERMINATE = """
import multiprocessing, sys, time
from kvlab.experiments.sim import workers
workers.TERMINATE_WAIT_S, workers.STRAGGLER_WAIT_S = 1.0, 0.5

def hold_the_result_lock(_):
    frame = sys._getframe()
    while 'outqueue' not in frame.f_locals:   # multiprocessing.pool.worker's frame holds the result queue
        frame = frame.f_back
    frame.f_locals['outqueue']._wlock.acquire()
    time.sleep(120)

if __name__ == '__main__':
    started = time.monotonic()
    try:
        with workers.worker_pool(2) as pool:
            pool.apply_async(hold_the_result_lock, (0,))
            time.sleep(1.0)
            raise RuntimeError('the block failed')
    except RuntimeError as exc:
        left = multiprocessing.active_children()
        print('raised', exc, 'after', round(time.monotonic() - started, 1), 's, children', left)
"""


def test_a_failed_block_is_not_held_up_by_a_pool_terminate_that_hangs(tmp_path):
    """multiprocessing.Pool.terminate sends the result queue a last message, under the queue's write lock; a worker
    that holds that lock (killed, or stuck, while it sent a result) makes terminate wait forever. The pool stops
    waiting for it, kills what is left, and the block's own error comes out."""
    import subprocess
    import sys
    script = tmp_path / "stuck_terminate.py"
    script.write_text(STUCK_TERMINATE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised the block failed" in done.stdout and "children []" in done.stdout, done.stdout
