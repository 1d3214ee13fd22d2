"""Ctrl-C anywhere in the CLI: SIGINT to a running command ends it with one "interrupted" line on stderr and exit
code 130, in bounded time, and (simulate --jobs) leaves no worker process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import alive, children

ROOT = Path(__file__).resolve().parents[1]


def interrupt(argv: list[str], ready) -> tuple[subprocess.Popen, str, list[int]]:
    """Start `kvlab argv`, wait until `ready(proc)` (at most 60 s), send SIGINT; -> (proc, stderr, workers seen)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not ready(proc) and time.monotonic() < deadline:
            assert proc.poll() is None, f"finished before the interrupt: {proc.communicate()}"
            time.sleep(0.1)
        workers = children(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        return proc, err, workers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip() and "disabled:" not in ln]


def test_sigint_stops_simulate_and_every_worker():
    started = time.monotonic()
    proc, err, workers = interrupt(
        ["simulate", "--policies", "paged,vmm", "--jobs", "2", "--num-requests", "200000", "--no-progress"],
        lambda p: len(children(p.pid)) >= 2 and time.monotonic() - started > 3)
    assert proc.returncode == 130, err
    assert lines(err) == ["kvlab simulate: interrupted"], err
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(w) for w in workers), "a simulate worker outlived the interrupted command"


@pytest.mark.parametrize("backend", ["vmm", pytest.param("paged", marks=pytest.mark.slow)])    # ~7 s each
def test_sigint_during_generation_is_one_line_and_exit_130(backend):
    started = time.monotonic()
    proc, err, _ = interrupt(["generate", "hi", "--backend", backend, "--max-tokens", "4000", "--ignore-eos",
                              "--max-model-len", "4096", "--kv-cache-bytes", "64MiB"],
                             lambda p: time.monotonic() - started > 6)
    assert proc.returncode == 130, err
    assert len(lines(err)) == 1 and lines(err)[0].startswith("kvlab generate: interrupted"), err


def torch_loading(pid: int) -> bool:
    try:
        return "/torch/" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def after_torch_loads(delay: float):
    """ready(proc): `delay` s after torch's libraries began to load in it. The command's own code runs by then (its
    start-up guard is in); before its first line (the interpreter and runpy starting: 50 ms or more on a loaded
    machine) a Ctrl-C is Python's own, as for any Python program, so a fixed delay from the start cannot aim."""
    since: list[float] = []

    def ready(proc: subprocess.Popen) -> bool:
        if not since and torch_loading(proc.pid):
            since.append(time.monotonic())
        return bool(since) and time.monotonic() - since[0] >= delay
    return ready


@pytest.mark.parametrize("delay", [0.0, 0.4])
def test_sigint_while_the_command_starts_is_one_line_and_exit_130(delay):
    """Importing torch takes a second or more: a Ctrl-C then used to end in a KeyboardInterrupt traceback, exit -2."""
    proc, err, _ = interrupt(["generate", "hi", "--backend", "vmm", "--max-tokens", "8"], after_torch_loads(delay))
    assert proc.returncode == 130, err
    assert lines(err) == ["kvlab generate: interrupted"], err
