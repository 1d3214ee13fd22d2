"""Becoming a pool member: create a pool under a name, or join one by name."""
from __future__ import annotations

import mmap
import os
import socket

from kvlab.vmm.pool import locks, rendezvous
from kvlab.vmm.pool.attachment import Attachment, liveness_byte
from kvlab.vmm.pool.errors import LimitError, PoolError
from kvlab.vmm.pool.ledger import MAX_PAGES, Ledger, ledger_bytes, to_pages
from kvlab.vmm.pool.member import PoolMember
from kvlab.vmm.pool.steward import Steward

DEFAULT_PAGE_SIZE = 64 * 1024
MAX_ENGINES = 64


def check_engine_name(engine: str) -> None:
    if not rendezvous.NAME.fullmatch(engine) or len(engine) > 48:
        raise PoolError(f"bad engine name {engine!r}: use 1-48 letters, digits, '.', '_' or '-'")


def enroll(attachment: Attachment, engine: str | None, floor: int, ceiling: int | None,
           server: socket.socket | None = None) -> PoolMember:
    """Register this process as engine `engine` (default engine-PID-SLOT); floor and ceiling in bytes, ceiling
    None = the whole pool."""
    if engine is not None:
        check_engine_name(engine)
    size = attachment.page_size
    with attachment.locked() as ledger:
        attachment.reap(ledger)                      # a dead engine's slot and name can be reused at once
        ceiling_pages = ledger.total if ceiling is None else to_pages(ceiling, size, "ceiling")
        slot = ledger.table.free_slot()
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
                     server: socket.socket | None = None) -> PoolMember:
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
    try:
        attachment = Attachment(name, *new_pool_files(name, nbytes, page_size, total))
    except BaseException:
        server.close()
        raise
    return _enroll_or_close(attachment, engine, floor, ceiling, server)


def new_pool_files(name: str, nbytes: int, page_size: int, total: int) -> tuple[int, int]:
    """The pages memfd and the books' memfd, formatted."""
    fds: list[int] = []
    try:
        fds.append(new_memfd(f"{rendezvous.PREFIX}{name}-pages", nbytes))
        fds.append(new_memfd(f"{rendezvous.PREFIX}{name}-ledger", ledger_bytes(total, MAX_ENGINES)))
        with mmap.mmap(fds[1], ledger_bytes(total, MAX_ENGINES)) as books:
            Ledger.format(books, page_size, total, MAX_ENGINES)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], fds[1]
