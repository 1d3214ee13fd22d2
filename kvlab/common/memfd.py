"""Memfds whose size cannot change once made (docs/security.md): a process that maps a memfd another process
passed dies of SIGBUS when it touches a page past the file's end, so the maker seals the size (F_SEAL_SHRINK,
F_SEAL_GROW, then F_SEAL_SEAL so no one adds F_SEAL_WRITE under the writers) and a receiver checks the seals and
the size (fstat) before it maps anything."""
from __future__ import annotations

import fcntl
import os

SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class UnsafeMemfd(OSError):
    """A descriptor that is not a size-sealed memfd of the expected size: mapping it could SIGBUS."""


def sealed(name: str, nbytes: int) -> int:
    """A new memfd of `nbytes` (close-on-exec) whose size is final."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check(fd: int, nbytes: int, what: str) -> None:
    """Raise UnsafeMemfd (one line) unless `fd` is a memfd sealed against resizing holding at least `nbytes`."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise UnsafeMemfd(f"{what} is not a sealable memfd: refused before mapping") from None
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise UnsafeMemfd(f"{what} is not sealed against resizing: refused before mapping (a shrink would SIGBUS)")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise UnsafeMemfd(f"{what} holds {size} bytes, {nbytes} expected: refused before mapping")
