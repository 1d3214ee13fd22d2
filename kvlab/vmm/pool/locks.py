"""Open-file-description (OFD) record locks on one byte each. The kernel releases them when the last descriptor
of their description closes, so when their process dies, kill -9 included. Each process locks through a
description of its own (`reopen`), never one it received or passes on: a received descriptor shares the sender's
description, and locks held through it would be the sender's."""
from __future__ import annotations

import errno
import fcntl
import os
import struct

FLOCK = "hhqqi4x"    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks); 32 bytes


def reopen(fd: int) -> int:
    """A new open file description of the file behind `fd` (works for memfds)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def _flock(kind: int, offset: int) -> bytes:
    return struct.pack(FLOCK, kind, os.SEEK_SET, offset, 1, 0)


def lock(fd: int, offset: int) -> None:
    """Wait for and take the write lock on byte `offset`."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_WRLCK, offset))


def try_lock(fd: int, offset: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, offset))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, offset: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, offset))


def held_elsewhere(fd: int, offset: int) -> bool:
    """Whether another description holds a lock on byte `offset` (this description's own locks do not count)."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, offset))
    return struct.unpack(FLOCK, got)[0] != fcntl.F_UNLCK
