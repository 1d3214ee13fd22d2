"""One accounting of this process's OS mappings (vm.max_map_count counts them per process), shared by every host
driver: several vmm caches in one process draw on one budget, and each sees the others' growth.

The room is re-read from the kernel (vm.max_map_count, the lines of /proc/self/maps) whenever the drivers have
grown by a quarter of the margin since the last reading, or a request would not fit: room = the limit - mappings
that are not ours - `margin` (left to torch, threads and libraries), within `KVLAB_MAP_BUDGET` if set (tests
lower it instead of exhausting the real limit). A refusal raises `MapBudgetExhausted`, which is also an
`OutOfKVCache`: the allocator treats it like running out of KV (allocate returns None). Only growth is refused:
an unmap that splits a mapping is counted but always allowed, so freeing and closing never fail for lack of room.

The process-wide budget is the one deliberate piece of global state in vmm: the kernel's limit is per process.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlab.common.errors import ConfigError, DriverError, OutOfKVCache

if TYPE_CHECKING:
    from kvlab.vmm.drivers.types import DriverStats

log = logging.getLogger("kvlab.vmm")

ENV_CAP = "KVLAB_MAP_BUDGET"
MARGIN = 4096              # mappings left to the rest of the process (torch, threads, libraries)
REREAD_SECONDS = 0.05      # a refused request re-reads the kernel's counts at most this often


class MapBudgetExhausted(DriverError, OutOfKVCache):
    """A map was refused: the process's mappings are spent. Out of room, like out of KV: nothing changed."""


def max_map_count() -> int:
    with open("/proc/sys/vm/max_map_count") as f:
        return int(f.read())


def process_map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def cap_from_env() -> int | None:
    raw = os.environ.get(ENV_CAP)
    if raw is None or raw == "":
        return None
    try:
        cap = int(raw)
    except ValueError:
        cap = -1
    if cap < 1:
        raise ConfigError(f"{ENV_CAP}={raw!r} is not a positive whole number of OS mappings")
    return cap


class MapBudget:
    """Mappings held by every driver sharing this budget (`held`) against the room the kernel leaves them.
    Thread-safe: caches in several threads share it."""

    def __init__(self, cap: int | None = None, margin: int = MARGIN, limit: Callable[[], int] = max_map_count,
                 count: Callable[[], int] = process_map_count) -> None:
        if cap is not None and cap < 1:
            raise ConfigError(f"a map budget needs a positive cap, not {cap}")
        self.cap, self.margin = cap, margin
        self.held = 0            # mappings booked by the drivers sharing the budget
        self.refusals = 0        # requests refused
        self._limit, self._count = limit, count
        self._lock = threading.Lock()
        self._room: int | None = None
        self._read_at = (0, 0.0)  # (held, monotonic time) when the room was last read

    def room(self) -> int:
        """The most mappings the drivers may hold together, read from the kernel now."""
        others = max(0, self._count() - self.held)
        room = self._limit() - others - self.margin
        return room if self.cap is None else min(room, self.cap)

    def check(self, delta: int, call: str) -> None:
        """Refuse (MapBudgetExhausted) a `call` that would add `delta` mappings past the room."""
        if delta <= 0:
            return
        with self._lock:
            want = self.held + delta
            held_then, read_then = self._read_at
            stale = self._room is None or self.held - held_then >= self.margin // 4
            if stale or (want > self._room and (self.held != held_then
                                                or time.monotonic() - read_then > REREAD_SECONDS)):
                self._room = self.room()
                self._read_at = (self.held, time.monotonic())
            if want <= self._room:
                return
            self.refusals += 1
            room = self._room
        log.warning("vmm: %s refused: %d mappings needed, this process's map budget is %d", call, want, room)
        raise MapBudgetExhausted(
            f"{call} would need {want} OS mappings, above this process's map budget of {room} (vm.max_map_count "
            f"minus other mappings minus {self.margin} left to the rest of the process, shared by every vmm cache"
            f"{'' if self.cap is None else f', capped by {ENV_CAP}'}); use a larger page_size or fewer caches")

    def add(self, delta: int) -> None:
        with self._lock:
            self.held += delta


class MappingCount:
    """One driver's OS mappings (`stats.num_mappings`), checked against its own limit (`limit`, None: none) and the
    budget it shares with the process's other drivers (`budget`, None: none), and booked in both."""

    def __init__(self, stats: DriverStats, limit: int | None, budget: MapBudget | None) -> None:
        self.stats, self.limit, self.budget = stats, limit, budget

    def check(self, delta: int, call: str) -> None:
        """Refuse growth past this driver's limit or the process's budget (MapBudgetExhausted: out of room, nothing
        changed). An unmap is checked against the driver's own limit only: freeing never waits for room."""
        st = self.stats
        if self.limit is not None and delta > 0 and st.num_mappings + delta > self.limit:
            st.map_refusals += 1
            raise MapBudgetExhausted(f"{call} would need {st.num_mappings + delta} mappings, above this driver's "
                                     f"budget of {self.limit} (vm.max_map_count); use a larger page_size or fewer "
                                     "scattered pages")
        if self.budget is not None and delta > 0 and call != "unmap":
            try:
                self.budget.check(delta, call)
            except MapBudgetExhausted:
                st.map_refusals += 1
                raise

    def add(self, delta: int) -> None:
        """Every change of this driver's mapping count, also booked in the process's budget."""
        self.stats.num_mappings += delta
        if self.budget is not None and delta:
            self.budget.add(delta)


_process: MapBudget | None = None
_process_lock = threading.Lock()


def process_budget() -> MapBudget:
    """The budget every host driver of this process shares (made on first use; `KVLAB_MAP_BUDGET` caps it)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = MapBudget(cap_from_env())
        return _process
