"""Starting ranks 1..tp-1 the way torchrun does: each is a fresh interpreter running `python -m
kvlab.common.dist.worker`, handed its work on its standard input (pickled: rank 0's sys.path, then a WorkerTask).
No worker imports or re-runs the user's __main__, so a script without an `if __name__ == "__main__":` guard,
`python -` and an interactive interpreter all work. A worker's standard output is its report pipe: the one line
saying why it failed, if it did (its prints go to its standard error)."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

WORKER_MODULE = "kvlab.common.dist.worker"


@dataclass(frozen=True, slots=True)
class WorkerTask:
    rank: int
    world: int
    port: int
    config: Any                   # EngineConfig
    parent_pid: int               # rank 0: the worker dies with it


class Worker:
    """One running rank: its process and its report pipe."""

    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank, self.proc = rank, proc
        os.set_blocking(proc.stdout.fileno(), False)
        self.report_text = b""

    def wait(self, timeout: float) -> int | None:
        """The exit code once the process has ended within `timeout` seconds, else None."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def report(self) -> str:
        """What the worker wrote on its report pipe so far (never blocks)."""
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
            except (BlockingIOError, ValueError, OSError):
                break
            if not chunk:
                break
            self.report_text += chunk
        return self.report_text.decode(errors="replace").strip()

    def close(self) -> None:
        self.kill()
        self.report()
        self.proc.stdout.close()

    def exit_reason(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "did not answer (still running; killed)"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"


def start_worker(task: WorkerTask) -> Worker:
    proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=worker_env(), close_fds=True)
    try:
        pickle.dump(list(sys.path), proc.stdin)
        pickle.dump(task, proc.stdin)
        proc.stdin.close()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return Worker(task.rank, proc)


def worker_env() -> dict[str, str]:
    """The environment plus the folder this process imported kvlab from, so `-m` finds the same kvlab before
    the worker reads the full sys.path."""
    root = os.path.dirname(sys.modules["kvlab"].__path__[0])
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def read_task(stream: Any) -> WorkerTask:
    """The worker's side of the hand-off: adopt rank 0's sys.path (what it can import, the worker can
    unpickle: a backend registered from a test folder, say), then read the task."""
    sys.path[:] = pickle.load(stream)
    return pickle.load(stream)
