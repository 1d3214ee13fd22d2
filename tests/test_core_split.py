"""The served-against-offline benchmark's CPU placement (experiments/bench/core_split.py): the engine on a CPU of
its own, the HTTP server and the load generator on the others."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from kvlab.experiments.bench import core_split as cs

ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to split")

# A stand-in `kvlab serve` (the argv the benchmark's launcher gives) with a child standing in for its engine.
FAKE_SERVER = ("import subprocess, sys, time\n"
               "engine = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
               "print(engine.pid, flush=True)\n"
               "time.sleep(30)\n")


def test_no_cpu_left_beside_the_engine_is_not_split_and_says_why(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    split, why = cs.core_split()
    assert split is None
    assert why == "not pinned: this process may use 1 CPU(s), none left beside the engine's 1 thread(s)"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5, 7})
    assert cs.core_split(engine_threads=3)[0] is None
    split, why = cs.core_split(engine_threads=2)
    assert split.engine == {2, 5} and split.front == {7}
    assert why == "engine on CPU 2,5, HTTP server and load generator on CPU 7"


@two_cpus
def test_the_engine_gets_the_first_cpu_and_the_front_the_rest():
    split, why = cs.core_split()
    assert split.engine == {min(ALLOWED)} and split.front == ALLOWED - {min(ALLOWED)}
    assert split.everything == ALLOWED and why.startswith(f"engine on CPU {min(ALLOWED)}, ")


@two_cpus
def test_a_run_is_on_its_cpus_and_the_process_is_back_on_all_after():
    split, _ = cs.core_split()
    seen = []
    run = cs.on_cpus(lambda: seen.append(frozenset(os.sched_getaffinity(0))) or 1.5, split.front, split.everything)
    assert run() == 1.5 and seen == [split.front]
    assert frozenset(os.sched_getaffinity(0)) == ALLOWED


@two_cpus
def test_a_server_goes_to_the_front_cpus_and_its_engine_to_the_engine_cpu():
    split, _ = cs.core_split()
    server = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, "kvlab.experiments.cli.main", "serve"],
                              stdout=subprocess.PIPE, text=True)
    engine = None
    try:
        engine = int(server.stdout.readline())
        deadline = time.monotonic() + 10
        while engine not in cs.children(server.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cs.pin_servers(split) == 1
        assert frozenset(os.sched_getaffinity(server.pid)) == split.front
        assert frozenset(os.sched_getaffinity(engine)) == split.engine
        assert cs.pin_servers(split, engine_thread=True) == 1         # the engine inside the server: its CPU
        assert frozenset(os.sched_getaffinity(server.pid)) == split.engine
    finally:
        if engine is not None:
            os.kill(engine, 9)
        server.kill()
        server.wait(timeout=10)


def test_runs_stay_unpinned_and_say_why_when_there_is_no_server_to_pin(caplog):
    offline, served = (lambda: 1.0), (lambda: 2.0)
    with caplog.at_level(logging.WARNING, logger="kvlab.bench"):
        got_offline, got_served, placement = cs.placed(offline, served, engine_threads=1, engine_thread=False)
    if len(ALLOWED) < 2:
        assert placement.startswith("not pinned: this process may use")
    else:
        assert placement == "not pinned: the benchmark's server was not found among this process's children"
    assert (got_offline, got_served) == (offline, served) and placement in caplog.text
