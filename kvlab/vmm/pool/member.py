"""An engine's membership in a pool (made by enroll.py's create or join): take and give pages, close.

    member = join("gpu0")                      # or create("gpu0", 8 << 30) in the first process
    pages = member.take(4)                     # reserved in the books, or None (nothing changed)
    for p in pages: map(member.page_fd, member.page_offset(p))     # MAP_FIXED|MAP_SHARED into a reservation
    member.give(pages)                         # after unmapping them
    member.close()                             # gives back whatever is still held
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from kvlab.vmm.pool import locks
from kvlab.vmm.pool.attachment import Attachment, liveness_byte
from kvlab.vmm.pool.engines import EngineRecord
from kvlab.vmm.pool.errors import PoolError
from kvlab.vmm.pool.ledger import HOST
from kvlab.vmm.pool.status import PoolStatus, read_status
from kvlab.vmm.pool.steward import Steward
from kvlab.vmm.pool.transfer import all_held, transfer


class PoolMember:
    """One engine in a pool. Not inherited by fork: a forked child joins on its own."""

    def __init__(self, attachment: Attachment, index: int, engine: str, steward: Steward) -> None:
        self._attachment, self.index, self.engine, self._steward = attachment, index, engine, steward
        self.name, self.pid = attachment.name, os.getpid()
        self.page_size, self.total_pages = attachment.page_size, attachment.ledger.total
        self.device = attachment.device                # HOST (-1), or the CUDA device whose chunks hold the pages
        # a host pool's memfd: page p at page_offset(p), MAP_SHARED (None on a GPU pool: its pages are in chunks)
        self.page_fd = attachment.pages_fd if self.device == HOST else None
        self.chunk_fds = list(attachment.memory_fds)   # a GPU pool's chunks, the pool's to close: import each once
        self.chunk_bytes = self.total_pages * self.page_size // len(self.chunk_fds) if self.chunk_fds else 0
        self.held: set[int] = set()                   # the pages this engine holds, as it knows them

    def page_offset(self, page: int) -> int:
        if not 0 <= page < self.total_pages:
            raise PoolError(f"page {page} is not in pool {self.name!r} (pages 0..{self.total_pages - 1})")
        return page * self.page_size

    def _usable(self) -> Attachment:
        if self._steward is None:
            raise PoolError(f"engine {self.engine!r} has left pool {self.name!r}")
        if os.getpid() != self.pid:
            raise PoolError(f"pool membership of {self.engine!r} does not cross fork(); join in the child")
        return self._attachment

    def take(self, n: int) -> list[int] | None:
        """n pages now this engine's, or None with nothing changed (pool short, own ceiling, others' floors).
        A refusal first returns dead engines' pages and tries once more."""
        if not _is_count(n) or not 1 <= n <= self.total_pages:
            raise PoolError(f"take needs a page count in [1, {self.total_pages}], got {str(n)[:40]}")
        attachment = self._usable()
        with attachment.locked() as ledger:
            pages = ledger.take(self.index, n)
            if pages is None and attachment.reap(ledger, self.index):
                pages = ledger.take(self.index, n)
        if pages is None:
            return None
        self.held.update(pages.tolist())
        return pages.tolist()

    def give(self, pages: Iterable[int]) -> None:
        """Unmapped pages back to the pool, all or none; their memory goes back to the OS (the next owner reads
        zeros)."""
        pages = list(pages)
        if not all(_is_count(p) for p in pages):
            raise PoolError(f"give takes page numbers (integers), got {str(pages)[:60]}")
        attachment = self._usable()
        if len(set(pages)) != len(pages) or not self.held.issuperset(pages):
            raise PoolError(f"engine {self.engine!r} can give only distinct pages it holds; "
                            f"{sorted(set(pages) - self.held)[:8] or 'duplicates'} are not")
        attachment.scrub(pages)                                # still ours: no one else can map them yet
        with attachment.locked() as ledger:
            ledger.give(self.index, np.asarray(pages, dtype=np.int64))
        self.held.difference_update(pages)

    def receive(self, giver: int, giver_pid: int, pages: list[int]) -> None:
        """Pages another engine (index `giver` in the pool's books) holds become this engine's, all or none
        (vmm/pool/transfer.py): TransferRefused past this engine's ceiling, PoolError if the giver does not hold
        them all."""
        with self._usable().locked() as ledger:
            transfer(ledger, giver, giver_pid, self.index, np.asarray(pages, dtype=np.int64))
        self.held.update(pages)

    def still_holds(self, pages: list[int]) -> bool:
        """Whether every one of `pages` is still this engine's (not transferred or reaped away)."""
        with self._usable().locked() as ledger:
            return all_held(ledger, self.index, np.asarray(pages, dtype=np.int64))

    def forget(self, pages: list[int]) -> None:
        """Pages another engine took by transfer: no longer this engine's to give (the books say so already)."""
        self.held.difference_update(pages)

    @contextmanager
    def asking(self, n: int) -> Iterator[None]:
        """After a refused take: ask the other engines to give back n spare pages (the elastic protocol) while in
        the block; on leaving it (they came, or the engine stopped waiting) stop asking."""
        with self._usable().locked() as ledger:
            ledger.ask(n)
        try:
            yield
        finally:
            with self._usable().locked() as ledger:
                ledger.withdraw(n)

    def others_givable(self) -> int:
        """Pages the other engines published they could give back if asked (within their floors)."""
        with self._usable().locked() as ledger:
            return ledger.table.givable(exclude=self.index)

    def room(self) -> int:
        """Pages this engine could get now (free, or given by others if asked), within its ceiling. Read without
        the lock: a capacity hint asked every step, never a promise (take decides)."""
        ledger = self._attachment.ledger
        return ledger.table.room(self.index, ledger.free)

    def publish(self, givable: int) -> None:
        """Tell askers how many pages this engine holds without need (spare, parked, idle cached)."""
        with self._usable().locked() as ledger:
            ledger.publish(self.index, givable)

    def serve(self, answer: Callable[[int], None], givable: Callable[[], int] | None = None,
              every_round: Callable[[], None] | None = None) -> None:
        """Call `answer(pages)` from the steward thread, about every 0.1 s, while refused engines want pages; then,
        each round, `every_round()` (the engine's own chores), then publish `givable()` (the pages this engine could
        give), if given."""
        self._usable()
        self._steward.on_wanted = answer

        def round_() -> None:
            if every_round is not None:
                every_round()
            if givable is not None:
                self.publish(givable())
        self._steward.on_round = round_

    def record(self) -> EngineRecord:
        with self._usable().locked() as ledger:
            return ledger.table.record(self.index)

    def books(self) -> tuple[int, EngineRecord]:
        """The pool's free pages and this engine's record, read in one locked step."""
        with self._usable().locked() as ledger:
            return ledger.free, ledger.table.record(self.index)

    def owned(self) -> list[int]:
        """The pages the books say this engine holds (the owner array, read under the lock)."""
        with self._usable().locked() as ledger:
            return ledger.pages_of(self.index).tolist()

    def status(self) -> PoolStatus:
        attachment = self._usable()
        with attachment.locked() as ledger:
            attachment.reap(ledger, self.index)
            return read_status(self.name, ledger)

    def close(self) -> None:
        """Leave the pool, giving back every page still held (unmap them first)."""
        if self._steward is None or os.getpid() != self.pid:
            return
        self._steward.stop()
        self._steward = None
        attachment = self._attachment
        with attachment.locked() as ledger:
            attachment.scrub(ledger.pages_of(self.index).tolist())
            ledger.unregister(self.index)
            locks.unlock(attachment.lock_fd, liveness_byte(self.index))
        attachment.close()
        self.held.clear()

    def __enter__(self) -> PoolMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_count(value: object) -> bool:
    """An integer (Python's or numpy's), not a bool or a float that happens to equal one."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
