"""How the server starts its engine process: forked when that is safe, else a fresh interpreter.

A fork reuses what the server has imported already (torch alone is ~2 s of CPU), so the engine is ready that much
sooner. It is safe only while the server runs one thread and has not initialised CUDA: a fork copies one thread
and no driver state (vLLM's engine-core processes follow the same rule). Otherwise `python -c CHILD` starts a new
interpreter that imports everything again. Either way the child runs in a session of its own, ignores SIGINT, sends
what it prints to stderr and reads nothing from stdin.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

# SIGINT is ignored before the first import: a terminal's Ctrl-C during the engine's start-up (torch loading) is the
# server's to handle, not a traceback of this process
CHILD = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import sys; "
         "from kvlab.experiments.serve.engine_process import child_main; sys.exit(child_main({fd}))")


class ForkedChild:
    """A forked process, with the part of `subprocess.Popen` the server uses (poll, wait, kill, returncode)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def fork_is_safe() -> bool:
    torch = sys.modules.get("torch")
    cuda_started = torch is not None and torch.cuda.is_initialized()
    return threading.active_count() == 1 and not cuda_started and hasattr(os, "fork")


def start_child(fd: int, close_in_child: Callable[[], None],
                main: Callable[[int], int]) -> ForkedChild | subprocess.Popen:
    """The engine process, given `fd` (its end of the socket pair). `close_in_child`: what the child must not keep
    (the server's end); `main`: the child's entry point when forked."""
    if not fork_is_safe():
        return subprocess.Popen([sys.executable, "-c", CHILD.format(fd=fd)], pass_fds=[fd], stdout=2,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    sys.stdout.flush()
    sys.stderr.flush()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})   # until the child has left the terminal's
    pid = os.fork()                                                      # process group and ignores Ctrl-C
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return ForkedChild(pid)
    code = 1
    try:                      # the child: never returns into the server's code
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        close_in_child()
        os.dup2(2, 1)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        code = main(fd)
    except BaseException:     # noqa: BLE001 - the child's last words go to the log, then it exits
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)
