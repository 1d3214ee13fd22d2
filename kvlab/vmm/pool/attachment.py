"""One process's hold on a pool: the books (ledger.py) mapped shared, a lock description of its own, and the
descriptors of the pool's memory (one memfd of pages on the host, one per chunk on a GPU: cuda_chunks.py). Byte 0
of the ledger file is the pool's lock; byte 1 + s is engine slot s's liveness lock, held by the engine's process
for as long as it lives (locks.py). Descriptors come from another process: the books' and the host pages' memfds
must be sealed against resizing and as long as the books say (common/memfd.py) before anything is mapped, so a
member that shrinks them cannot SIGBUS the others (docs/security.md)."""
from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterable, Iterator

from kvlab.common import memfd
from kvlab.vmm.pool import locks
from kvlab.vmm.pool.errors import PoolError
from kvlab.vmm.pool.ledger import HEADER, HOST, Ledger, ledger_bytes
from kvlab.vmm.pool.memory import punch
from kvlab.vmm.pool.status import device_text

POOL_LOCK = 0
LIVENESS = 1


def liveness_byte(slot: int) -> int:
    return LIVENESS + slot


class Attachment:
    """Owns `ledger_fd` and `memory_fds` from the start, closing them if it fails (they are the descriptors passed
    to joiners; no lock is ever taken through them)."""

    def __init__(self, name: str, ledger_fd: int, memory_fds: list[int]) -> None:
        self.name, self.ledger_fd, self.memory_fds = name, ledger_fd, list(memory_fds)
        self.lock_fd, self._map, self.ledger = None, None, None
        self._thread_lock = threading.Lock()     # the OFD lock does not exclude this process's own threads
        try:
            self._check_sealed(ledger_fd, HEADER.itemsize, "books")
            self.lock_fd = locks.reopen(ledger_fd)
            self._map = mmap.mmap(self.lock_fd, os.fstat(self.lock_fd).st_size)
            self.ledger = self._read_books()
            self._check_memory()
        except BaseException:
            self.close()
            raise
        self.page_size, self.device = int(self.ledger.header["page_size"]), self.ledger.device

    def _check_sealed(self, fd: int, nbytes: int, what: str) -> None:
        try:
            memfd.check(fd, nbytes, f"pool {self.name!r}'s {what}")
        except memfd.UnsafeMemfd as exc:
            raise PoolError(str(exc)) from None

    def _read_books(self) -> Ledger:
        try:
            ledger = Ledger(self._map)
        except (ValueError, TypeError):       # counts in the header that the file cannot hold
            raise PoolError(f"pool {self.name!r} passed books too short for their own header") from None
        ledger.check(self.name)
        h = ledger.header
        if os.fstat(self.lock_fd).st_size < ledger_bytes(ledger.total, len(ledger.engines)) or h["page_size"] <= 0:
            raise PoolError(f"pool {self.name!r} passed malformed books")
        return ledger

    def _check_memory(self) -> None:
        if len(self.memory_fds) != int(self.ledger.header["chunks"]):
            raise PoolError(f"pool {self.name!r} passed {len(self.memory_fds)} memory descriptors for books that "
                            f"say {int(self.ledger.header['chunks'])}")
        if self.ledger.device == HOST:
            self._check_sealed(self.memory_fds[0], self.ledger.total * int(self.ledger.header["page_size"]), "pages")

    @property
    def descriptors(self) -> list[int]:
        """What a joiner is passed: the books first, then the memory."""
        return [self.ledger_fd, *self.memory_fds]

    @property
    def pages_fd(self) -> int:
        """The host pool's memfd of pages."""
        if self.device != HOST:
            raise PoolError(f"pool {self.name!r} holds its pages on {device_text(self.device)}, not in a memfd")
        return self.memory_fds[0]

    def scrub(self, pages: Iterable[int]) -> None:
        """Pages no engine holds now: on the host their memory goes back to the OS (the next owner reads zeros);
        a GPU chunk cannot give part of itself back, so there the next owner zeroes what it takes."""
        if self.device == HOST:
            punch(self.pages_fd, self.page_size, pages)

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
            self.scrub(ledger.pages_of(slot).tolist())
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
        for fd in (self.lock_fd, self.ledger_fd, *self.memory_fds):
            if fd is not None:
                os.close(fd)
        self.memory_fds = []
