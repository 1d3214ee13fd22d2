"""How kvlab serve starts its engine process (experiments/serve/engine_start.py): forked only while the server runs
one thread with CUDA untouched, else a new interpreter; a forked child answers poll, wait and kill as Popen does."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from kvlab.experiments.serve import engine_start


def exits_with(code: int):
    return lambda fd: code


def sleeps(fd: int) -> int:
    time.sleep(60)
    return 0


def test_a_second_thread_makes_it_a_new_interpreter():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert not engine_start.fork_is_safe()
    finally:
        stop.set()
        worker.join()


@pytest.fixture
def forking(monkeypatch):
    monkeypatch.setattr(engine_start, "fork_is_safe", lambda: True)
    ours, theirs = socket.socketpair()
    yield lambda main: engine_start.start_child(theirs.fileno(), ours.close, main)
    ours.close()
    theirs.close()


def test_a_forked_child_reports_its_exit_code(forking):
    child = forking(exits_with(3))
    assert isinstance(child, engine_start.ForkedChild)
    assert child.wait(30) == 3 and child.poll() == 3 and child.returncode == 3


def test_a_forked_child_runs_in_a_session_of_its_own_and_dies_by_kill(forking):
    child = forking(sleeps)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    deadline = time.monotonic() + 10
    while os.getsid(child.pid) == os.getsid(0) and time.monotonic() < deadline:   # setsid runs right after fork
        time.sleep(0.01)
    assert os.getsid(child.pid) == child.pid
    child.kill()
    assert child.wait(10) == -9
    child.kill()                                     # once reaped, harmless


def test_a_forked_child_that_raises_exits_1(forking):
    def boom(fd: int) -> int:
        raise RuntimeError("boom")
    assert forking(boom).wait(30) == 1
