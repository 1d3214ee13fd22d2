"""A Ctrl-C held for the length of a block. Raised inside a Python callback that C++ code made (torch's
`__torch_function__` modes through pybind11), a KeyboardInterrupt cannot unwind the C++ frames: the process
aborts ("terminate called after throwing ... error_already_set", exit -6) instead of exiting 130 with one line.
Held, it is raised as the block ends. Only the main thread, and only while Python's own SIGINT handler is set."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_held() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt
