"""Becoming a pool member: create a pool under a name, or join one by name."""
from __future__ import annotations

import mmap
import os
import socket
import uuid
from collections.abc import Callable

from kvlab.common import memfd
from kvlab.common.errors import ConfigError
from kvlab.vmm.pool import locks, rendezvous
from kvlab.vmm.pool.attachment import Attachment, liveness_byte
from kvlab.vmm.pool.errors import LimitError, PageSizeMismatch, PoolError, PoolExists, UnknownPool
from kvlab.vmm.pool.ledger import HOST, MAX_PAGES, Ledger, ledger_bytes, to_pages
from kvlab.vmm.pool.member import PoolMember
from kvlab.vmm.pool.status import device_text
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


def check_integer(what: str, value: object) -> None:
    if type(value) is not int:
        raise LimitError(f"{what} must be an integer number of bytes, got {str(value)[:40]!r}")


def check_geometry(nbytes: int, page_size: int) -> int:
    """The page count of a pool of `nbytes` in pages of `page_size`."""
    for what, value in (("pool size", nbytes), ("page size", page_size)):
        check_integer(what, value)
    if page_size <= 0 or page_size % mmap.PAGESIZE:
        raise LimitError(f"page size {page_size} is not a positive multiple of the OS page ({mmap.PAGESIZE})")
    if nbytes <= 0 or nbytes % page_size:
        raise LimitError(f"pool size {nbytes} is not a positive multiple of the page size {page_size}")
    if nbytes // page_size > MAX_PAGES:
        raise LimitError(f"pool of {nbytes // page_size} pages is over the most ({MAX_PAGES}); use larger pages")
    return nbytes // page_size


def new_memfd(name: str, nbytes: int) -> int:
    """A memfd whose size is sealed (common/memfd.py): no member can shrink the books or pages under another."""
    return memfd.sealed(name, nbytes)


def create(name: str, nbytes: int, page_size: int = DEFAULT_PAGE_SIZE, engine: str | None = None, floor: int = 0,
           ceiling: int | None = None, memory: Callable[[], list[int]] | None = None,
           device: int = HOST) -> PoolMember:
    """A new pool of `nbytes` in pages of `page_size`, served under `name`; this process is its first engine.
    `memory`, called once the name is claimed: the descriptors of the pool's memory, owned by the pool from then
    (default: one memfd of `nbytes`); `device`: HOST, or the GPU whose chunks they are (cuda_chunks.py).
    Nothing is named in the filesystem: the pool lives as long as one member does."""
    rendezvous.check_name(name)
    total = check_geometry(nbytes, page_size)
    if memory is None and device != HOST:        # the default memory is a host memfd
        raise LimitError(f"device {str(device)[:40]!r}: a pool on a GPU needs its memory (vmm/drivers/pooled_cuda.py)")
    server = rendezvous.claim(name)
    try:
        memory_fds = memory() if memory is not None else [new_memfd(f"{rendezvous.PREFIX}{name}-pages", nbytes)]
        attachment = Attachment(name, new_books(name, page_size, total, device, memory_fds), memory_fds)
    except BaseException:
        server.close()
        raise
    return _enroll_or_close(attachment, engine, floor, ceiling, server)


def new_books(name: str, page_size: int, total: int, device: int, memory_fds: list[int]) -> int:
    """The books' memfd, formatted; on failure the memory's descriptors are closed too."""
    fd = None
    try:
        if len(memory_fds) > rendezvous.MAX_MEMORY_FDS:
            raise LimitError(f"a pool's memory is at most {rendezvous.MAX_MEMORY_FDS} descriptors, not "
                             f"{len(memory_fds)}")
        fd = new_memfd(f"{rendezvous.PREFIX}{name}-ledger", ledger_bytes(total, MAX_ENGINES))
        with mmap.mmap(fd, ledger_bytes(total, MAX_ENGINES)) as books:
            Ledger.format(books, page_size, total, MAX_ENGINES, device, len(memory_fds))
    except BaseException:
        for f in memory_fds + ([fd] if fd is not None else []):
            os.close(f)
        raise
    return fd


def join_or_create(name: str, nbytes: int | None, page_size: int, device: int = HOST,
                   memory: Callable[[], list[int]] | None = None, backend: str = "vmm") -> PoolMember:
    """An engine's way in: join pool `name`, or create it with `nbytes` (and `memory`, as `create`) if it does
    not exist and a size was given; the pool must hold its pages on `device`, in pages of `page_size`. The
    engine goes by `backend`-PID-TAG in the books."""
    engine = f"{backend}-{os.getpid()}-{uuid.uuid4().hex[:12]}"     # unique: two engines of one process included
    try:
        member = join(name, engine=engine)
    except UnknownPool:
        if nbytes is None:
            flag = "" if device == HOST else f" --device {device_text(device)}"
            raise ConfigError(f"no pool named {name!r} is running; create it (kvlab pool create {name} --bytes N"
                              f"{flag}) or give kv_pool_bytes") from None
        try:
            return create(name, nbytes, page_size=page_size, engine=engine, memory=memory, device=device)
        except PoolExists:                    # another engine created it first
            member = join(name, engine=engine)
    return fitting(member, page_size, device)


def fitting(member: PoolMember, page_size: int, device: int) -> PoolMember:
    """The member, if its pool's pages are where and what size this engine maps; else it leaves, in one line."""
    problem = None
    if member.device != device:
        problem = (f"holds its pages on {device_text(member.device)}; an engine on {device_text(device)} cannot map "
                   "them (run every engine of a pool on its device)")
    elif member.page_size != page_size:
        problem = (f"has a page size {member.page_size}, not the engine's page_size {page_size}; set page_size "
                   f"(--page-size) to {member.page_size}")
    if problem is None:
        return member
    member.close()
    if member.device == device:     # then the page size is what is wrong
        raise PageSizeMismatch(f"pool {member.name!r} {problem}", member.page_size)
    raise ConfigError(f"pool {member.name!r} {problem}")
