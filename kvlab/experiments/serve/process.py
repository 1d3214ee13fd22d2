"""A `kvlab serve` subprocess that cannot hang its caller: its output goes to a log file (no pipe to fill up
while it serves), its start line (the URL, port 0 chosen by the OS) is read from the log and /health awaited
within one deadline, and it is always stopped (SIGTERM, then kill), a failure named by its log's last line."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvlab.experiments.serve.health import ServerNotReady, wait_healthy

POLL_S = 0.1
STOP_TIMEOUT_S = 30
log = logging.getLogger("kvlab.serve")


def launch(argv: list[str], log_file: Path) -> subprocess.Popen:
    """`kvlab serve ARGV --host 127.0.0.1 --port 0`, its stdout and stderr into `log_file`."""
    cmd = [sys.executable, "-m", "kvlab.experiments.cli.main", "serve", *argv, "--host", "127.0.0.1", "--port", "0"]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:                  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ), text=True)


def wait_serving(proc: subprocess.Popen, log_file: Path, deadline: float) -> str:
    """The server's URL once it prints it and answers /health; ServerNotReady in one line if it exits (with its
    log's last line) or runs past `deadline` (with where its log is)."""
    try:
        url = wait_url(proc, log_file, deadline)
        wait_healthy(url, max(deadline - time.monotonic(), 0.0), proc)
    except ServerNotReady as e:
        raise ServerNotReady(f"{e}: {last_line(log_file)}" if proc.poll() is not None else f"{e}; see {log_file}"
                             ) from None
    return url


def wait_url(proc: subprocess.Popen, log_file: Path, deadline: float) -> str:
    """The URL of the server's start line, once its log has it."""
    while (url := started_url(log_file)) is None:
        if proc.poll() is not None:
            raise ServerNotReady(f"kvlab serve exited with {proc.returncode} before serving")
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"kvlab serve ({log_file.name}) printed no start line in time")
        time.sleep(POLL_S)
    return url


def started_url(log_file: Path) -> str | None:
    m = re.search(r"on (http://\S+)", log_file.read_text())
    return m.group(1) if m else None


def last_line(log_file: Path) -> str:
    lines = log_file.read_text().strip().splitlines() if log_file.exists() else []
    return lines[-1][:300] if lines else "no output"


def stop(proc: subprocess.Popen, what: str, log_file: Path) -> None:
    """SIGTERM, then kill after STOP_TIMEOUT_S; a non-zero exit is logged with the log's last line."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            log.warning("%s ignored SIGTERM for %d s; killed", what, STOP_TIMEOUT_S)
    if proc.returncode != 0:
        log.warning("%s exited with %s: %s", what, proc.returncode, last_line(log_file))
