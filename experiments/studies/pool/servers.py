"""The servers of one configuration: `kvlab serve` subprocesses on free loopback ports (port 0, the chosen port
read from the server's first line), each bounded in time to start, always stopped (SIGTERM, then kill), their
output in log files of the results directory; and the check that a configuration's pool is gone after them."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen.sweep import stop
from kvlab.experiments.serve.health import ServerNotReady, wait_healthy

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
            procs.append(launch(argv, model, logs / f"server{i}.log"))
        deadline = time.monotonic() + timeout_s
        yield [Launched(wait_serving(p, logs / f"server{i}.log", deadline), p.pid) for i, p in enumerate(procs)]
    finally:
        for i, proc in enumerate(procs):
            stop(proc, f"server {i}")


def launch(argv: list[str], model: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvlab.experiments.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", "0", *argv]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:                  # the child keeps its own descriptor: no pipe to fill up
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ), text=True)


def wait_serving(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    """The server's URL once it prints it and answers /health; a one-line error if it exits or runs late (its
    log's last line, or where its log is)."""
    try:
        url = wait_url(proc, log, deadline)
        wait_healthy(url, max(deadline - time.monotonic(), 0.0), proc)
    except ServerNotReady as e:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise ServerNotReady(f"{e}: {tail[0][:200]}" if proc.poll() is not None else f"{e}; see {log}") from None
    return url


def wait_url(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    """The URL of the server's start line, once its log has it."""
    while (url := started_url(log)) is None:
        if proc.poll() is not None:
            raise ServerNotReady(f"kvlab serve exited with {proc.returncode} before serving")
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"kvlab serve ({log.name}) printed no start line in time")
        time.sleep(POLL_S)
    return url


def started_url(log: Path) -> str | None:
    m = re.search(r"on (http://\S+)", log.read_text())
    return m.group(1) if m else None


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
