"""Background mapping: a worker thread maps the pages a slot will need soon, off the critical path.

The worker changes the cache's tables only under the cache's lock. Before the cache touches a slot it fences
that slot (waits for its job); a worker error is re-raised there, in the caller, never lost.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import Slot

LOOKAHEAD_FRACTION = 8   # background mapping starts when a sequence is within 1/8 page of its next page

MapAhead = Callable[[int, int, int], bool]   # (slot index, owner seq_id, target pages) -> mapped anything


class BackgroundMapper:
    def __init__(self, geo: Geometry, lock: threading.RLock, map_ahead: MapAhead, enabled: bool) -> None:
        self.geo = geo
        self.lock = lock
        self.seconds = 0.0                      # worker time spent mapping
        self.pending: dict[int, Future] = {}    # slot index -> its in-flight job
        self._map_ahead = map_ahead
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvlab-vmm-mapper") if enabled else None
        self.enabled = enabled

    def request(self, slot: Slot, tokens: int) -> None:
        """Map ahead of a slot that now holds `tokens` tokens, if it is near its next page."""
        if self._executor is None:
            return
        ahead = max(1, self.geo.tokens_per_page // LOOKAHEAD_FRACTION)
        target = min(self.geo.pages_for(tokens + ahead), self.geo.pages_per_slot)
        if target > len(slot.groups) and slot.index not in self.pending:
            self.pending[slot.index] = self._executor.submit(self._run, slot.index, slot.seq_id, target)

    def _run(self, index: int, seq_id: int, target: int) -> None:
        with self.lock:
            t0 = time.perf_counter()
            if self._map_ahead(index, seq_id, target):
                self.seconds += time.perf_counter() - t0

    def fence(self, indices: list[int | None]) -> None:
        """Wait for in-flight mapping of these slots; re-raise any background error here, in the caller."""
        if not self.pending:
            return
        for index in indices:
            future = self.pending.pop(index, None) if index is not None else None
            if future is not None:
                future.result()
        for index, future in list(self.pending.items()):
            if future.done():
                del self.pending[index]
                future.result()

    def close(self) -> BaseException | None:
        """Stop the worker; returns the first error a job left behind (the caller raises it)."""
        error = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            for future in self.pending.values():
                error = error or future.exception()
            self.pending.clear()
        return error
