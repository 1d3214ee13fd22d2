"""The accounting driver's books for a mirror (places mapped in lockstep, vmm/drivers/base.py): one page table for all
places instead of one per place, so a map or unmap of a run costs the same for 2 tensors or 64.

Every place holds the same pages, so the OS mappings inside each place change alike (times the number of
places); only the edges where places meet, or meet unmapped space, need their own count. The per-place tables
(`Region.mapped`, `segments`) and the driver's store page counts are rebuilt from these books when read.
"""
from __future__ import annotations

from array import array
from collections import Counter

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.types import Mirror
from kvlab.vmm.drivers.vmas import boundary, count_vmas, map_delta, unmap_delta


class MirrorBooks:
    """Books for one mirror. `vmas` (the OS mappings of its ranges) and the counts the driver reports are kept
    as maps change; the per-place tables are written by `sync`, which every read of them calls."""

    def __init__(self, mirror: Mirror, page_size: int, merges: bool, store_maps: array) -> None:
        self.mirror, self.page_size, self.merges = mirror, page_size, merges
        self.size = mirror.span // page_size        # pages per place
        self.width = len(mirror.places)
        self.rows: dict[int, int] = {}              # page of a place -> store page that place 0 maps there
        self._synced: dict[int, int] = {}           # the rows last written into the per-place tables
        self._dirty = False
        self._store_maps = store_maps
        self.open_starts, self.open_ends, self.meets = place_edges(mirror)
        self.ranges = list({id(r): r for r, _ in mirror.places}.values())
        self.vmas = sum(r.vmas for r in self.ranges)   # OS mappings of those ranges, kept as maps change

    # -- checks -------------------------------------------------------------------------------------------
    def check_unmapped(self, first: int, count: int) -> None:
        for j in range(first, first + count):
            if j in self.rows:
                raise DriverError(f"VA page {j} of every mirrored place is already mapped; unmap it first")

    def check_mapped(self, first: int, count: int) -> None:
        for j in range(first, first + count):
            if j not in self.rows:
                raise DriverError(f"VA page {j} of the mirrored places is not mapped")

    # -- OS mappings added, over all places ---------------------------------------------------------------
    def map_delta(self, first: int, count: int, page: int) -> int:
        if not self.merges:
            return self.width * count
        inner = map_delta(self.rows, first, count, page, self.size)
        after_first = page if first == 0 else self.rows.get(0)
        after_last = page + count - 1 if first + count == self.size else self.rows.get(self.size - 1)
        return self.width * inner + self._outer_delta(first, count, after_first, after_last)

    def unmap_delta(self, first: int, count: int) -> int:
        if not self.merges:
            return -self.width * count
        inner = unmap_delta(self.rows, first, count, self.size)
        after_first = None if first == 0 else self.rows.get(0)
        after_last = None if first + count == self.size else self.rows.get(self.size - 1)
        return self.width * inner + self._outer_delta(first, count, after_first, after_last)

    def _outer_delta(self, first: int, count: int, after_first: int | None, after_last: int | None) -> int:
        if first != 0 and first + count != self.size:
            return 0
        return self._outer(after_first, after_last) - self._outer(self.rows.get(0), self.rows.get(self.size - 1))

    def _outer(self, first: int | None, last: int | None) -> int:
        """Boundaries on the edges of the places, given what place 0 maps at its first and last page."""
        count = self.open_starts * (first is not None) + self.open_ends * (last is not None)
        for shift, n in self.meets.items():   # place k's last page meets place k + shift // stride's first
            count += n * boundary(last, None if first is None else first + shift)
        return count

    # -- changes ------------------------------------------------------------------------------------------
    def map(self, first: int, count: int, page: int, delta: int) -> None:
        self.rows.update(zip(range(first, first + count), range(page, page + count)))
        self.vmas += delta
        self._dirty = True

    def unmap(self, first: int, count: int, delta: int) -> None:
        for j in range(first, first + count):
            del self.rows[j]
        self.vmas += delta
        self._dirty = True

    def unmap_all(self) -> tuple[int, int, int]:
        """Unmap every page of every place, as releasing the ranges does (one call per run of mapped VA pages,
        runs joining where places meet). Returns (calls, pages, OS mappings added)."""
        rows = self.rows
        runs = sum(1 for j in rows if j - 1 not in rows)
        joined = sum(self.meets.values()) if 0 in rows and self.size - 1 in rows else 0
        calls, pages = self.width * runs - joined, self.width * len(rows)
        empty = len(self.ranges) * (1 if self.merges else 0)
        delta, self.vmas = empty - self.vmas, empty
        self.rows = {}
        self._dirty = True
        return calls, pages, delta

    def sync(self) -> None:
        """Write the books into every place's table, the ranges' mapping counts and the store page counts."""
        if not self._dirty:
            return
        stride, maps = self.mirror.store_stride, self._store_maps
        for i, (region, offset) in enumerate(self.mirror.places):
            base, shift, pages = offset // self.page_size, i * stride, region.pages
            for j, p in self._synced.items():
                del pages[base + j]
                maps[p + shift] -= 1
            for j, p in self.rows.items():
                pages[base + j] = p + shift
                maps[p + shift] += 1
        for region in self.ranges:
            size = region.nbytes // self.page_size
            region.vmas = count_vmas(region.pages, size) if self.merges else len(region.pages)
        self._synced = dict(self.rows)
        self._dirty = False


def place_edges(mirror: Mirror) -> tuple[int, int, Counter[int]]:
    """Edges of places that are not a range's own edges: (starts next to unmapped space, ends next to unmapped
    space, {store shift between two places that meet: how many meet so})."""
    starts = {(id(r), off): i for i, (r, off) in enumerate(mirror.places)}
    ends = {(id(r), off + mirror.span): i for i, (r, off) in enumerate(mirror.places)}
    open_starts = open_ends = 0
    meets: Counter[int] = Counter()
    for i, (region, offset) in enumerate(mirror.places):
        if offset > 0:
            before = ends.get((id(region), offset))
            if before is None:
                open_starts += 1
            else:
                meets[(i - before) * mirror.store_stride] += 1
        end = offset + mirror.span
        if end < region.nbytes and (id(region), end) not in starts:
            open_ends += 1
    return open_starts, open_ends, meets
