"""The `kvlab` command's start-up: importing torch takes a second or more, and a Ctrl-C in that time would end in
a KeyboardInterrupt traceback (exit -2) instead of the one line and exit code 130 that a Ctrl-C later gets.
Nothing is held yet (no cache, no worker, no memfd), so the start-up handler just says so and exits; the default
handler comes back before the command runs. Standard library only: this module must import instantly."""
from __future__ import annotations

import os
import signal
import sys


def _stop(signum: int, frame: object) -> None:
    command = next((a for a in sys.argv[1:] if a.isidentifier()), "")
    os.write(2, f"kvlab{' ' + command if command else ''}: interrupted\n".encode())
    os._exit(130)


def guard_startup() -> None:
    """Until end_startup(): SIGINT ends the process with one line and 130 (unless SIGINT is ignored)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop)


def end_startup() -> None:
    if signal.getsignal(signal.SIGINT) is _stop:
        signal.signal(signal.SIGINT, signal.default_int_handler)
