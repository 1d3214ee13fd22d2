"""An engine's membership in a pool: create or join by name, take and give pages, close.

    member = join("gpu0")                      # or create("gpu0", 8 << 30) in the first process
    pages = member.take(4)                     # reserved in the books, or None (nothing changed)
    for p in pages: map(member.page_fd, member.page_offset(p))     # MAP_FIXED|MAP_SHARED into a reservation
    member.give(pages)                         # after unmapping them
    member.close()                             # gives back whatever is still held
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Iterable

import numpy as np

from kvlab.vmm.pool import locks, rendezvous
from kvlab.vmm.pool.attachment import Attachment, liveness_byte
from kvlab.vmm.pool.errors import LimitError, PoolError
from kvlab.vmm.pool.ledger import MAX_PAGES, EngineRecord, Ledger, ledger_bytes
from kvlab.vmm.pool.memory import punch
from kvlab.vmm.pool.status import PoolStatus, read_status
from kvlab.vmm.pool.steward import Steward

DEFAULT_PAGE_SIZE = 64 * 1024
MAX_ENGINES = 64


def to_pages(nbytes: int, page_size: int, what: str) -> int:
    if nbytes < 0 or nbytes % page_size:
        raise LimitError(f"{what} {nbytes} is not a non-negative multiple of the pool's page size {page_size}")
    return nbytes // page_size


class PoolMember:
    """One engine in a pool. Not inherited by fork: a forked child joins on its own."""

    def __init__(self, attachment: Attachment, slot: int, engine: str, steward: Steward) -> None:
        self._attachment, self.slot, self.engine, self._steward = attachment, slot, engine, steward
        self.name, self.pid = attachment.name, os.getpid()
        self.page_size, self.total_pages = attachment.page_size, attachment.ledger.total
        self._held: set[int] = set()

    @property
    def page_fd(self) -> int:
        """The pool's memfd: map page p at offset page_offset(p), MAP_SHARED."""
        return self._attachment.pages_fd

    def page_offset(self, page: int) -> int:
        if not 0 <= page < self.total_pages:
            raise PoolError(f"page {page} is not in pool {self.name!r} (pages 0..{self.total_pages - 1})")
        return page * self.page_size

    @property
    def held(self) -> list[int]:
        return sorted(self._held)

    def _usable(self) -> Attachment:
        if self._steward is None:
            raise PoolError(f"engine {self.engine!r} has left pool {self.name!r}")
        if os.getpid() != self.pid:
            raise PoolError(f"pool membership of {self.engine!r} does not cross fork(); join in the child")
        return self._attachment

    def take(self, n: int) -> list[int] | None:
        """n pages now this engine's, or None with nothing changed (pool short, own ceiling, others' floors).
        A refusal first returns dead engines' pages and tries once more."""
        if not isinstance(n, int) or n < 1:
            raise PoolError(f"take needs a positive page count, got {n!r}")
        attachment = self._usable()
        with attachment.locked() as ledger:
            pages = ledger.take(self.slot, n)
            if pages is None and attachment.reap(ledger, self.slot):
                pages = ledger.take(self.slot, n)
        if pages is None:
            return None
        self._held.update(pages.tolist())
        return pages.tolist()

    def give(self, pages: Iterable[int]) -> None:
        """Unmapped pages back to the pool, all or none; their memory goes back to the OS (the next owner reads
        zeros)."""
        pages = list(pages)
        attachment = self._usable()
        if len(set(pages)) != len(pages) or not self._held.issuperset(pages):
            raise PoolError(f"engine {self.engine!r} can give only distinct pages it holds; "
                            f"{sorted(set(pages) - self._held)[:8] or 'duplicates'} are not")
        punch(attachment.pages_fd, self.page_size, pages)       # still ours: no one else can map them yet
        with attachment.locked() as ledger:
            ledger.give(self.slot, np.asarray(pages, dtype=np.int64))
        self._held.difference_update(pages)

    def record(self) -> EngineRecord:
        with self._usable().locked() as ledger:
            return ledger.record(self.slot)

    def excess(self) -> int:
        """Pages held above the ceiling (after a limit was lowered): what the engine should give back."""
        r = self.record()
        return max(0, r.held - r.ceiling)

    def status(self) -> PoolStatus:
        attachment = self._usable()
        with attachment.locked() as ledger:
            attachment.reap(ledger, self.slot)
            return read_status(self.name, ledger)

    def close(self) -> None:
        """Leave the pool, giving back every page still held (unmap them first)."""
        if self._steward is None or os.getpid() != self.pid:
            return
        self._steward.stop()
        self._steward = None
        attachment = self._attachment
        with attachment.locked() as ledger:
            punch(attachment.pages_fd, self.page_size, ledger.pages_of(self.slot).tolist())
            ledger.unregister(self.slot)
            locks.unlock(attachment.lock_fd, liveness_byte(self.slot))
        attachment.close()
        self._held.clear()

    def __enter__(self) -> PoolMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_engine_name(engine: str) -> None:
    if not rendezvous.NAME.fullmatch(engine) or len(engine) > 48:
        raise PoolError(f"bad engine name {engine!r}: use 1-48 letters, digits, '.', '_' or '-'")


def enroll(attachment: Attachment, engine: str | None, floor: int, ceiling: int | None,
           server=None) -> PoolMember:
    """Register this process as engine `engine` (default engine-PID-SLOT); floor and ceiling in bytes, ceiling
    None = the whole pool."""
    if engine is not None:
        check_engine_name(engine)
    size = attachment.page_size
    with attachment.locked() as ledger:
        attachment.reap(ledger)                      # a dead engine's slot and name can be reused at once
        ceiling_pages = ledger.total if ceiling is None else to_pages(ceiling, size, "ceiling")
        slot = ledger.free_slot()
        engine = engine or f"engine-{os.getpid()}-{slot}"
        if not locks.try_lock(attachment.lock_fd, liveness_byte(slot)):
            raise PoolError(f"slot {slot} of pool {attachment.name!r} is locked by an unregistered process")
        try:
            ledger.register(slot, os.getpid(), engine, to_pages(floor, size, "floor"), ceiling_pages)
        except BaseException:
            locks.unlock(attachment.lock_fd, liveness_byte(slot))
            raise
    return PoolMember(attachment, slot, engine, Steward(attachment, slot, server))


def _enroll_or_close(attachment: Attachment, engine: str | None, floor: int, ceiling: int | None,
                     server=None) -> PoolMember:
    try:
        return enroll(attachment, engine, floor, ceiling, server)
    except BaseException:
        if server is not None:
            server.close()
        attachment.close()
        raise


def join(name: str, engine: str | None = None, floor: int = 0, ceiling: int | None = None) -> PoolMember:
    """Join the pool served under `name` as engine `engine`; floor and ceiling in bytes."""
    return _enroll_or_close(Attachment(name, *rendezvous.fetch(name)), engine, floor, ceiling)


def check_geometry(nbytes: int, page_size: int) -> int:
    """The page count of a pool of `nbytes` in pages of `page_size`."""
    if page_size <= 0 or page_size % mmap.PAGESIZE:
        raise LimitError(f"page size {page_size} is not a positive multiple of the OS page ({mmap.PAGESIZE})")
    if nbytes <= 0 or nbytes % page_size:
        raise LimitError(f"pool size {nbytes} is not a positive multiple of the page size {page_size}")
    if nbytes // page_size > MAX_PAGES:
        raise LimitError(f"pool of {nbytes // page_size} pages is over the most ({MAX_PAGES}); use larger pages")
    return nbytes // page_size


def new_memfd(name: str, nbytes: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd


def create(name: str, nbytes: int, page_size: int = DEFAULT_PAGE_SIZE, engine: str | None = None, floor: int = 0,
           ceiling: int | None = None) -> PoolMember:
    """A new pool of `nbytes` in pages of `page_size`, served under `name`; this process is its first engine.
    Nothing is named in the filesystem: the pool lives as long as one member does."""
    rendezvous.check_name(name)
    total = check_geometry(nbytes, page_size)
    server = rendezvous.claim(name)
    fds: list[int] = []
    try:
        fds.append(new_memfd(f"{rendezvous.PREFIX}{name}-pages", nbytes))
        fds.append(new_memfd(f"{rendezvous.PREFIX}{name}-ledger", ledger_bytes(total, MAX_ENGINES)))
        with mmap.mmap(fds[1], ledger_bytes(total, MAX_ENGINES)) as books:
            Ledger.format(books, page_size, total, MAX_ENGINES)
        attachment = Attachment(name, *fds)
    except BaseException:
        server.close()
        for fd in fds:
            os.close(fd)
        raise
    return _enroll_or_close(attachment, engine, floor, ceiling, server)
