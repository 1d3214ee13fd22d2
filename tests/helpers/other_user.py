"""A process of another user for the cross-user tests (docs/security.md): stdlib Python run as uid/gid 65534 through
`setpriv`, bounded in time and killed at teardown. Tests skip, with the reason, where that cannot run."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534
PYTHON = "/usr/bin/python3"            # the project's interpreter lives where uid 65534 cannot read it
LIFETIME_S = 60


def skip_unless_possible() -> None:
    if os.getuid() != 0:
        pytest.skip("a cross-user test must run as root to start a process as uid 65534")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    if not os.access(PYTHON, os.X_OK):
        pytest.skip(f"no system Python at {PYTHON} for the uid-65534 process")


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A folder uid 65534 can read (pytest's tmp_path is root's alone), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvlab-other-user-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start(script: Path, *args: str) -> subprocess.Popen:
    """Run `script` (in a shared_dir) as uid 65534 for at most LIFETIME_S; it prints one line once it is ready."""
    script.chmod(0o644)
    cmd = ["timeout", str(LIFETIME_S), "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
           PYTHON, str(script), *args]
    return started(cmd)


def started(cmd: list[str]) -> subprocess.Popen:
    """`cmd` in a session of its own (stop() kills all of it: `timeout` and what it runs), once it printed a line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if not line:
        stop(proc)
        raise AssertionError(f"the uid-{NOBODY} process did not start: {proc.stderr.read()[-400:]}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        stream.close()


