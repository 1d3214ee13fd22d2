"""The engine records of the pool's books: one row per slot, read and checked under the pool's lock.

The rows live in the ledger's shared mapping (ledger.py lays it out); this class reads them and checks limits
against them. It changes nothing: every change goes through the Ledger, which marks the books dirty around it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlab.common.machine import fmt_bytes
from kvlab.vmm.pool.errors import LimitError, PoolError

NAME_BYTES = 48
ENGINE = np.dtype([("in_use", "<i8"), ("pid", "<i8"), ("floor", "<i8"), ("ceiling", "<i8"), ("held", "<i8"),
                   ("given", "<i8"), ("taken", "<i8"), ("name", f"S{NAME_BYTES}"),
                   ("givable", "<i8")])      # pages the engine holds without need, as it last published (a hint)


@dataclass(frozen=True)
class EngineRecord:
    slot: int
    pid: int
    name: str
    floor: int       # pages
    ceiling: int
    held: int
    given: int
    taken: int
    givable: int = 0     # spare, parked and idle cached pages, as last published


class EngineTable:
    def __init__(self, rows: np.ndarray, total_pages: int, page_size: int) -> None:
        self.rows, self.total, self.page_size = rows, total_pages, page_size

    def live_slots(self) -> list[int]:
        return np.flatnonzero(self.rows["in_use"]).tolist()

    def record(self, slot: int) -> EngineRecord:
        e = self.rows[slot]
        return EngineRecord(slot, int(e["pid"]), e["name"].decode(), int(e["floor"]), int(e["ceiling"]),
                            int(e["held"]), int(e["given"]), int(e["taken"]), int(e["givable"]))

    def records(self) -> list[EngineRecord]:
        return [self.record(slot) for slot in self.live_slots()]

    def find(self, engine: str) -> int | None:
        """The live slot of the engine named `engine`, or whose pid is `engine`."""
        for r in self.records():
            if engine in (r.name, str(r.pid)):
                return r.slot
        return None

    def unmet_floors(self, exclude: int | None = None) -> int:
        """Free pages promised to engines below their floor (other than `exclude`)."""
        live = self.rows["in_use"] != 0
        if exclude is not None:
            live[exclude] = False
        unmet = self.rows["floor"][live] - self.rows["held"][live]
        return int(np.clip(unmet, 0, None).sum())

    def givable(self, exclude: int) -> int:
        """Pages live engines other than `exclude` could give now: each one's published count, within its floor."""
        live = self.rows["in_use"] != 0
        live[exclude] = False
        rows = self.rows[live]
        return int(np.clip(np.minimum(rows["givable"], rows["held"] - rows["floor"]), 0, None).sum())

    def room(self, slot: int, free: int) -> int:
        """Pages engine `slot` could get now: free ones past others' unmet floors, and others' givable ones,
        within its ceiling."""
        e = self.rows[slot]
        pool = max(0, free - self.unmet_floors(exclude=slot)) + self.givable(exclude=slot)
        return max(0, min(int(e["ceiling"] - e["held"]), pool))

    def free_slot(self) -> int:
        slots = np.flatnonzero(self.rows["in_use"] == 0)
        if not len(slots):
            raise PoolError(f"the pool has {len(self.rows)} engines, its most; close one first")
        return int(slots[0])

    def pages_text(self, pages: int) -> str:
        return f"{pages} pages ({fmt_bytes(pages * self.page_size)})"

    def check_limits(self, slot: int, floor: int, ceiling: int) -> None:
        if not 0 <= floor <= ceiling <= self.total:
            raise LimitError(f"limits need 0 <= floor <= ceiling <= the pool's {self.pages_text(self.total)}; got "
                             f"floor {self.pages_text(floor)}, ceiling {self.pages_text(ceiling)}")
        live = self.rows["in_use"] != 0
        live[slot] = False
        others = int(self.rows["floor"][live].sum())
        if others + floor > self.total:
            raise LimitError(f"floor {self.pages_text(floor)} does not fit: other engines' floors take "
                             f"{self.pages_text(others)} of the pool's {self.pages_text(self.total)}")
