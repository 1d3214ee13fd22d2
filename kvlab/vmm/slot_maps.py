"""Mapping page groups at a slot's pages: one mirrored driver call per run of consecutive groups maps a page in
all 2L tensors at once. Every call is all or nothing: the driver's mirrored calls undo their own partial work, and
a failed run here unmaps the runs before it. Only if an undo fails too (`TornMirror`) does a slot list a page that
is not mapped alike in every tensor; such pages are remembered (`torn`) and cleared, not unmapped, later.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.types import TornMirror

if TYPE_CHECKING:
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.drivers.types import Mirror
    from kvlab.vmm.free_pages import FreePages, PageCounters
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import Slot

log = logging.getLogger("kvlab.vmm")


class SlotMaps:
    """The driver calls of the page moves (vmm/pages.py), addressed by (slot, page); mapping lists the groups in
    the slot and counts them in the free list."""

    def __init__(self, geo: Geometry, driver: VirtualMemory, mirror: Mirror, free_pages: FreePages,
                 counters: PageCounters) -> None:
        self.driver, self.mirror, self.free_pages, self.counters = driver, mirror, free_pages, counters
        self.torn: set[tuple[int, int]] = set()   # (slot, page) maybe not mapped alike in every tensor (TornMirror)
        self._row_bytes, self._page_size = geo.row_bytes, geo.page_size

    def _at(self, slot: int, page: int) -> int:
        """Where page `page` of slot `slot` sits inside each tensor."""
        return slot * self._row_bytes + page * self._page_size

    def append(self, slot: Slot, groups: list[int], shared: bool) -> None:
        """Map `groups` after the slot's last page (one call per run) and list them: owned (fresh from the free list) or
        shared (a fork, a prefix hit). All or nothing: a failure unmaps the runs mapped so far and gives fresh
        groups back to the free list. Should an undo fail too, what is still (partly) mapped stays listed."""
        first, mapped = len(slot.groups), 0
        try:
            for start, n in group_runs(groups):
                mapped = start + n
                self.driver.map_mirrored(self.mirror, self._at(slot.index, first + start), groups[start], n)
        except TornMirror:
            self.mark_torn(slot, first + start, n)
            raise
        except BaseException:
            mapped = self._unmap_back(slot, first, groups, start)   # the failed run left nothing mapped
            raise
        finally:
            self._list(slot, groups, mapped, shared)

    def _list(self, slot: Slot, groups: list[int], mapped: int, shared: bool) -> None:
        kept = groups[:mapped]
        slot.groups.extend(kept)
        if shared:
            self.free_pages.share(kept)
        else:
            self.free_pages.own(kept)
            self.free_pages.return_untaken(groups[mapped:])

    def _unmap_back(self, slot: Slot, first: int, groups: list[int], mapped: int) -> int:
        """Unmap the runs of groups[:mapped] (mapped at pages first..), last first; returns how many groups stay
        mapped (all up to the run whose unmap failed)."""
        for start, n in reversed(group_runs(groups[:mapped])):
            try:
                self.driver.unmap_mirrored(self.mirror, self._at(slot.index, first + start), n)
            except DriverError as exc:
                if isinstance(exc, TornMirror):
                    self.mark_torn(slot, first + start, n)
                log.error("vmm: undoing a failed map of slot %d failed too (%s); pages %d..%d stay mapped and listed",
                          slot.index, exc, first, first + start + n - 1)
                return start + n
        return 0

    def unmap(self, slot: Slot, first: int, end: int) -> None:
        """Unmap pages [first, end) of the slot in every tensor, all or nothing (a torn page is cleared instead)."""
        count = end - first
        torn = [(slot.index, j) for j in range(first, end) if (slot.index, j) in self.torn] if self.torn else []
        try:
            if torn:
                self.driver.clear_mirrored(self.mirror, self._at(slot.index, first), count)
            else:
                self.driver.unmap_mirrored(self.mirror, self._at(slot.index, first), count)
        except TornMirror:
            self.mark_torn(slot, first, count)
            raise
        if torn:
            self.torn.difference_update(torn)
            self.counters.torn_pages = len(self.torn)

    def remap(self, slot: Slot, j: int, old: int, new: int) -> None:
        """Copy-on-write's driver calls: group `new` (just taken) at page j in place of the shared `old`. A failure
        gives `new` back and leaves `old` mapped; if mapping `old` back fails too: TornMirror."""
        at = self._at(slot.index, j)
        try:
            self.driver.unmap_mirrored(self.mirror, at, 1)
        except BaseException as exc:
            self.free_pages.return_untaken([new])   # the slot still lists `old`
            if isinstance(exc, TornMirror):
                self.mark_torn(slot, j, 1)
            raise
        try:
            self.driver.map_mirrored(self.mirror, at, new, 1)
        except TornMirror:
            self._take(slot, j, old, new)   # partly mapped: the slot lists the copy
            self.mark_torn(slot, j, 1)
            raise
        except BaseException as exc:
            self.free_pages.return_untaken([new])
            self._map_back(slot, j, old, exc)
            raise
        self._take(slot, j, old, new)

    def _take(self, slot: Slot, j: int, old: int, new: int) -> None:
        self.free_pages.unshare(old)
        slot.groups[j] = new
        self.free_pages.own([new])

    def _map_back(self, slot: Slot, j: int, old: int, exc: BaseException) -> None:
        """Map the shared group `old` back at page j after its copy failed to map."""
        try:
            self.driver.map_mirrored(self.mirror, self._at(slot.index, j), old, 1)
        except DriverError as undo:
            self.mark_torn(slot, j, 1)
            raise TornMirror(f"copy-on-write of slot {slot.index} page {j} failed ({exc}) and mapping the shared page "
                             f"back failed too ({undo}): the slot lists a page that is not mapped; close the cache"
                             ) from exc

    def mark_torn(self, slot: Slot, first: int, count: int) -> None:
        self.torn.update((slot.index, j) for j in range(first, first + count))
        self.counters.torn_pages = len(self.torn)

    def first_torn(self, slot: Slot) -> int | None:
        return min((j for s, j in self.torn if s == slot.index), default=None)


def group_runs(groups: list[int]) -> list[tuple[int, int]]:
    """(index, length) runs of consecutive group ids (each run is one map call per tensor)."""
    out: list[tuple[int, int]] = []
    for i, g in enumerate(groups):
        if out and groups[out[-1][0]] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
