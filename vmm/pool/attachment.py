"""One process's hold on a pool: the pages memfd, the books (ledger.py) mapped shared, and a lock description of
its own. Byte 0 of the ledger file is the pool's lock; byte 1 + s is engine slot s's liveness lock, held by the
engine's process for as long as it lives (locks.py)."""
from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator

from kvlab.vmm.pool import locks
from kvlab.vmm.pool.ledger import Ledger
from kvlab.vmm.pool.memory import punch

POOL_LOCK = 0
LIVENESS = 1


def liveness_byte(slot: int) -> int:
    return LIVENESS + slot


class Attachment:
    """Owns `pages_fd` and `ledger_fd` from the start, closing them if it fails (they are the descriptors passed
    to joiners; no lock is ever taken through them)."""

    def __init__(self, name: str, pages_fd: int, ledger_fd: int) -> None:
        self.name, self.pages_fd, self.ledger_fd = name, pages_fd, ledger_fd
        self.lock_fd, self._map, self.ledger = None, None, None
        self._thread_lock = threading.Lock()     # the OFD lock does not exclude this process's own threads
        try:
            self.lock_fd = locks.reopen(ledger_fd)
            self._map = mmap.mmap(self.lock_fd, os.fstat(self.lock_fd).st_size)
            self.ledger = Ledger(self._map)
            self.ledger.check(name)
        except BaseException:
            self.close()
            raise
        self.page_size = int(self.ledger.header["page_size"])

    @contextlib.contextmanager
    def locked(self) -> Iterator[Ledger]:
        """The books, alone, brought back to consistency if their last writer died mid-change."""
        with self._thread_lock:
            locks.lock(self.lock_fd, POOL_LOCK)
            try:
                if self.ledger.header["dirty"]:
                    self.ledger.recount()
                yield self.ledger
            finally:
                locks.unlock(self.lock_fd, POOL_LOCK)

    def reap(self, ledger: Ledger, own_slot: int | None = None) -> int:
        """Under the lock: return the pages of every engine whose process is gone; how many engines were."""
        dead = [s for s in ledger.table.live_slots()
                if s != own_slot and not locks.held_elsewhere(self.lock_fd, liveness_byte(s))]
        for slot in dead:
            punch(self.pages_fd, self.page_size, ledger.pages_of(slot).tolist())
            ledger.reclaim(slot)
        return len(dead)

    def close(self) -> None:
        self.ledger = None
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:    # a caller's frame still holds a view of the books: unmapped when it goes
            pass
        self._map = None
        for fd in (self.lock_fd, self.ledger_fd, self.pages_fd):
            if fd is not None:
                os.close(fd)
