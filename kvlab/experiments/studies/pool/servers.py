"""The servers of one configuration: `kvlab serve` subprocesses (experiments/serve/process.py: port 0, bounded in
time to start, always stopped) started at once, their output in log files of the results directory; and the
check that a configuration's pool is gone after them."""
from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvlab.common.errors import ConfigError
from kvlab.experiments.serve.process import launch, stop, wait_serving

POLL_S = 0.1
POOL_GONE_S = 5.0          # the last member's exit ends the pool; the kernel may take a moment to close it all


@dataclass(frozen=True, slots=True)
class Launched:
    url: str
    pid: int


@contextlib.contextmanager
def servers(argvs: list[list[str]], model: str, logs: Path, timeout_s: float) -> Iterator[list[Launched]]:
    """Starts one server per argv at once; yields them once every one answers /health."""
    procs: list[subprocess.Popen] = []
    try:
        for i, argv in enumerate(argvs):
            procs.append(launch(["--model", model, *argv], logs / f"server{i}.log"))
        deadline = time.monotonic() + timeout_s
        yield [Launched(wait_serving(p, logs / f"server{i}.log", deadline), p.pid) for i, p in enumerate(procs)]
    finally:
        for i, proc in enumerate(procs):
            stop(proc, f"server {i}", logs / f"server{i}.log")


def check_pool_gone(name: str) -> None:
    """After its servers stopped, the pool must be gone (nothing outlives the last engine)."""
    from kvlab.vmm.pool import UnknownPool, status
    deadline = time.monotonic() + POOL_GONE_S
    while time.monotonic() < deadline:
        try:
            status(name)
        except UnknownPool:
            return
        time.sleep(POLL_S)
    raise ConfigError(f"pool {name!r} outlived its servers by {POOL_GONE_S:g} s")
