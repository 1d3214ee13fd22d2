"""The pool's books, in one shared mapping: a header, one record per engine slot, and the owner of every page.

Every method runs under the pool's lock (attachment.py), so each reads and changes the books alone. The owner
array is the truth; `free` and each engine's `held` are counts kept beside it. A change marks the header dirty
first and clean last, so a process killed inside one leaves the books dirty, and the next lock holder recounts
from the owner array (`recount`). A page is owned by an engine before it can be mapped: `take` checks and marks in
one locked step, and either gives n pages or changes nothing.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from kvlab.vmm.pool.engines import ENGINE, NAME_BYTES, EngineTable
from kvlab.vmm.pool.errors import LimitError, PoolError

FREE = -1
MAGIC = 0x6B766C61622D706C    # "kvlab-pl"
VERSION = 4                      # 3: engine records carry `givable`; 4: the header says where the memory is
HOST = -1                        # `device` of a pool whose pages are one memfd; else the CUDA device's ordinal
HEADER = np.dtype([("magic", "<u8"), ("version", "<i8"), ("page_size", "<i8"), ("total_pages", "<i8"),
                   ("device", "<i8"),      # HOST, or the ordinal of the GPU whose chunks hold the pages
                   ("chunks", "<i8"),      # the memory's descriptors passed at join: 1 memfd, or the CUDA chunks
                   ("max_engines", "<i8"), ("free", "<i8"), ("dirty", "<i8"), ("reclaimed_pages", "<i8"),
                   ("reclaimed_engines", "<i8"), ("joins", "<i8"),
                   ("hint", "<i8"),        # every page below `hint` is owned: take searches from there
                   ("wanted", "<i8")])     # pages refused engines asked for: others give spares back
OWNER = np.dtype("<i4")
MAX_PAGES = 2**31 - 1            # page ids fit the owner array's int32


def to_pages(nbytes: int, page_size: int, what: str) -> int:
    if nbytes < 0 or nbytes % page_size:
        raise LimitError(f"{what} {nbytes} is not a non-negative multiple of the pool's page size {page_size}")
    return nbytes // page_size


def ledger_bytes(total_pages: int, max_engines: int) -> int:
    return HEADER.itemsize + max_engines * ENGINE.itemsize + total_pages * OWNER.itemsize


class Ledger:
    def __init__(self, buf) -> None:
        self.header = np.frombuffer(buf, HEADER, 1)[0]
        engines = int(self.header["max_engines"])
        self.engines = np.frombuffer(buf, ENGINE, engines, HEADER.itemsize)
        self.owner = np.frombuffer(buf, OWNER, int(self.header["total_pages"]),
                                   HEADER.itemsize + engines * ENGINE.itemsize)
        self.table = EngineTable(self.engines, len(self.owner), int(self.header["page_size"]))

    @staticmethod
    def format(buf, page_size: int, total_pages: int, max_engines: int, device: int = HOST, chunks: int = 1) -> None:
        """Write empty books into `buf` (zeroed, ledger_bytes long)."""
        header = np.frombuffer(buf, HEADER, 1)[0]
        header["page_size"], header["total_pages"], header["max_engines"] = page_size, total_pages, max_engines
        header["device"], header["chunks"] = device, chunks
        header["free"] = total_pages
        np.frombuffer(buf, OWNER, total_pages, HEADER.itemsize + max_engines * ENGINE.itemsize)[:] = FREE
        header["version"], header["magic"] = VERSION, MAGIC      # last: the books are whole

    def check(self, name: str) -> None:
        if self.header["magic"] != MAGIC or self.header["version"] != VERSION:
            raise PoolError(f"pool {name!r} has books of another kvlab version (format {self.header['version']})")

    # -- reading --------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return int(self.header["total_pages"])

    @property
    def free(self) -> int:
        return int(self.header["free"])

    @property
    def device(self) -> int:
        """HOST, or the CUDA device whose chunks hold the pages."""
        return int(self.header["device"])

    def pages_of(self, slot: int) -> np.ndarray:
        return np.flatnonzero(self.owner == slot)

    # -- changing -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        self.header["dirty"] = 1
        yield
        self.header["dirty"] = 0

    def recount(self) -> None:
        """Rebuild the counts from the owner array after a process died inside a change. Pages of a slot no
        longer in use go back to the pool."""
        live = self.engines["in_use"] != 0
        owned = self.owner >= 0
        orphans = np.flatnonzero(owned)[~live[self.owner[owned]]]
        self.owner[orphans] = FREE
        self.engines["held"] = np.bincount(self.owner[self.owner >= 0], minlength=len(self.engines))
        free = np.flatnonzero(self.owner == FREE)
        self.header["free"] = len(free)
        self.header["hint"] = free[0] if len(free) else self.total
        self.header["dirty"] = 0

    def register(self, slot: int, pid: int, name: str, floor: int, ceiling: int) -> None:
        if self.table.find(name) is not None:
            raise PoolError(f"an engine named {name!r} is already in the pool; give another name")
        self.table.check_limits(slot, floor, ceiling)
        with self.changing():
            e = self.engines[slot]
            e["pid"], e["name"], e["floor"], e["ceiling"] = pid, name.encode()[:NAME_BYTES], floor, ceiling
            e["held"] = e["given"] = e["taken"] = e["givable"] = 0
            e["in_use"] = 1
        self.header["joins"] += 1

    def unregister(self, slot: int) -> int:
        """Free the slot and every page it holds; returns how many pages went back."""
        pages = self.pages_of(slot)
        with self.changing():
            self.release(pages)
            self.engines[slot] = np.zeros((), ENGINE)
        return len(pages)

    def reclaim(self, slot: int) -> int:
        """Unregister a dead engine, counting what came back."""
        count = self.unregister(slot)
        self.header["reclaimed_pages"] += count
        self.header["reclaimed_engines"] += 1
        return count

    def take(self, slot: int, n: int) -> np.ndarray | None:
        """n free pages now owned by `slot`, or None (nothing changed) when that would pass its ceiling, or leave
        fewer free pages than other engines' unmet floors."""
        e = self.engines[slot]
        if e["held"] + n > e["ceiling"] or self.free - n < self.table.unmet_floors(exclude=slot):
            return None
        pages = self.lowest_free(n)
        with self.changing():
            self.owner[pages] = slot
            e["held"] += n
            e["taken"] += n
            self.header["free"] -= n
            self.header["hint"] = pages[-1] + 1
        return pages

    def lowest_free(self, n: int) -> np.ndarray:
        """The n lowest free pages (the caller checked there are n), searched from the hint in blocks that double,
        so a take costs about the span it covers, not the pool's size."""
        found: list[np.ndarray] = []
        start, block, count = int(self.header["hint"]), 1024, 0
        while count < n and start < self.total:
            free = np.flatnonzero(self.owner[start:start + block] == FREE)[:n - count] + start
            found.append(free)
            count += len(free)
            start, block = start + block, block * 2
        if count < n:                # counts that disagree with the owner array: never by this code's changes
            self.header["dirty"] = 1     # the next lock holder recounts
            raise PoolError(f"the pool's books disagree (found {count} of {n} free pages); recounting")
        return np.concatenate(found)

    def release(self, pages: np.ndarray) -> None:
        """Inside a change: the pages are free again."""
        self.owner[pages] = FREE
        self.header["free"] += len(pages)
        if len(pages):
            self.header["hint"] = min(int(self.header["hint"]), int(pages.min()))

    def give(self, slot: int, pages: np.ndarray) -> None:
        """Pages of `slot` back to the pool; all or none (a page it does not hold refuses the whole call)."""
        if len(np.unique(pages)) != len(pages) or not np.all((pages >= 0) & (pages < self.total)):
            raise PoolError(f"give takes distinct page ids in [0, {self.total}), got {pages.tolist()[:8]}")
        if not np.all(self.owner[pages] == slot):
            stray = pages[self.owner[pages] != slot][:8].tolist()
            raise PoolError(f"engine {self.table.record(slot).name!r} does not hold pages {stray}")
        e = self.engines[slot]
        with self.changing():
            self.release(pages)
            e["held"] -= len(pages)
            e["given"] += len(pages)
            self.header["wanted"] = max(0, int(self.header["wanted"]) - len(pages))

    def ask(self, n: int) -> None:
        """A refused engine wants n pages: members holding spare pages give them back when they next look."""
        self.header["wanted"] = min(self.total, int(self.header["wanted"]) + n)

    def withdraw(self, n: int) -> None:
        """An engine stops waiting for the n pages it asked for (given, or given up): gives already lowered the
        count, so it drops by what is left of n at most (a hint: a later refusal asks again)."""
        self.header["wanted"] = max(0, int(self.header["wanted"]) - n)

    def publish(self, slot: int, givable: int) -> None:
        """The engine's count of pages it holds without need (a hint for askers: never read by take)."""
        self.engines[slot]["givable"] = max(0, givable)

    def set_limits(self, slot: int, floor: int, ceiling: int) -> None:
        """Each intermediate state is valid too: the floor goes first unless it would pass the old ceiling."""
        self.table.check_limits(slot, floor, ceiling)
        e = self.engines[slot]
        with self.changing():
            if floor > e["ceiling"]:
                e["ceiling"], e["floor"] = ceiling, floor
            else:
                e["floor"], e["ceiling"] = floor, ceiling
