"""Places mapped in lockstep (the vmm cache's 2L tensors): a `Mirror` names them, and one `map_mirrored` call
maps a run of pages in all of them (one OS call per place; the accounting driver books it once for all,
vmm/accounting.py). The mirrored calls are all or nothing: a failure undoes the places already done. Only when
an undo fails too are the places left apart, and `TornMirror` says so; `clear_mirrored` is the way out.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from kvlab.common.errors import DriverError
from kvlab.vmm.vmas import runs

if TYPE_CHECKING:
    from kvlab.vmm.driver import Region
    from kvlab.vmm.ledger import MirrorLedger

log = logging.getLogger("kvlab.vmm")


class TornMirror(DriverError):
    """A mirrored call failed and so did its undo: its places no longer match (the books say what each maps)."""


@dataclass(slots=True, eq=False)
class Mirror:
    """Places mapped in lockstep (the vmm cache's 2L tensors): every map or unmap applies at the same offset in
    each place, and place i maps pool page `page + i * pool_stride` where place 0 maps `page`."""
    places: tuple[tuple[Region, int], ...]   # (range, byte offset of the place in it)
    span: int                                # bytes per place
    pool_stride: int
    ledger: MirrorLedger | None = None       # accounting drivers: the books kept once for all places


class MirroredMaps:
    """The mirrored calls of `VirtualMemory` (vmm/driver.py), built on its checked, booked `map` and `unmap`."""

    def mirror(self, places: list[tuple[Region, int]], span: int, pool_stride: int) -> Mirror:
        """Declare places (range, offset) of `span` bytes each that are always mapped in lockstep."""
        self._check_open()
        if span <= 0 or span % self.page_size or pool_stride < 0:
            raise DriverError(f"a mirror needs a whole number of pages per place, not {span} bytes")
        for region, offset in places:
            self._va_page(region, offset, span // self.page_size)
        spans = sorted((id(r), off) for r, off in places)
        if any(a == c and d < b + span for (a, b), (c, d) in pairwise(spans)):
            raise DriverError("mirrored places overlap; give each its own span")
        return Mirror(tuple(places), span, pool_stride)

    def map_mirrored(self, mirror: Mirror, offset: int, page: int, num_pages: int = 1) -> None:
        """Map pool pages [page + i * stride, +num_pages) at `offset` of every place i; all or nothing (a failure
        unmaps the places already mapped)."""
        self._check_mirror_offset(mirror, offset, num_pages)
        self._check_pool(page, num_pages + (len(mirror.places) - 1) * mirror.pool_stride, len(self.pool_maps))
        before = []
        for region, base in mirror.places:   # refuse before any place changes
            va = self._va_page(region, base + offset, num_pages)
            self._check_unmapped(region, va, num_pages)
            before.append((region, va, {}))
        try:
            for i, (region, base) in enumerate(mirror.places):
                self.map(region, base + offset, page + i * mirror.pool_stride, num_pages)
        except BaseException as exc:
            self._undo_mirrored(exc, "map", offset, num_pages, before)
            raise

    def unmap_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        """Unmap [offset, + num_pages pages) of every place; all or nothing (a failure maps the places already
        unmapped again: the pool pages kept their data)."""
        self._check_mirror_offset(mirror, offset, num_pages)
        before = []
        for region, base in mirror.places:   # refuse before any place changes
            va = self._va_page(region, base + offset, num_pages)
            self._check_mapped(region, va, num_pages)
            pages = region.mapped
            before.append((region, va, {i: pages[i] for i in range(va, va + num_pages)}))
        try:
            for region, base in mirror.places:
                self.unmap(region, base + offset, num_pages)
        except BaseException as exc:
            self._undo_mirrored(exc, "unmap", offset, num_pages, before)
            raise

    def clear_mirrored(self, mirror: Mirror, offset: int, num_pages: int = 1) -> None:
        """Unmap whatever is mapped at [offset, + num_pages pages) of each place: the way out of a TornMirror.
        Tries every place; raises TornMirror if some unmap still fails."""
        self._check_mirror_offset(mirror, offset, num_pages)
        errors = []
        for region, base in mirror.places:
            errors += self._restore(region, self._va_page(region, base + offset, num_pages), num_pages, {})
        if errors:
            raise TornMirror(f"clearing {num_pages} page(s) at offset {offset} of {len(mirror.places)} mirrored "
                             f"places failed ({errors[0]}); close the cache") from errors[0]

    def _undo_mirrored(self, exc: BaseException, call: str, offset: int, num_pages: int,
                       before: list[tuple[Region, int, dict[int, int]]]) -> None:
        """Put every place's pages [va, +num_pages) back as `before` says (VA page -> pool page; absent: unmapped).
        Returns if that worked (the caller re-raises `exc`); raises TornMirror naming both failures if not."""
        errors = []
        for region, va, want in before:
            errors += self._restore(region, va, num_pages, want)
        if not errors:
            return
        log.error("%s of mirrored pages at offset %d failed (%s) and undoing it failed too (%s); the places no "
                  "longer match", call, offset, exc, errors[0])
        raise TornMirror(f"{call} of {num_pages} page(s) at offset {offset} of {len(before)} mirrored places failed "
                         f"({exc}) and undoing it failed too ({errors[0]}): the places are torn (the driver's books "
                         "say what is mapped); close the cache") from exc

    def _restore(self, region: Region, va: int, num_pages: int, want: dict[int, int]) -> list[DriverError]:
        """Unmap what should not be mapped in [va, +num_pages), then map what is missing; try all, return failures."""
        errors: list[DriverError] = []
        have = region.mapped
        extra = [i for i in range(va, va + num_pages) if i in have and have[i] != want.get(i)]
        for start, count in runs(extra):
            try:
                self.unmap(region, start * self.page_size, count)
            except DriverError as err:
                errors.append(err)
        missing = [i for i in range(va, va + num_pages) if i in want and i not in have]
        for start, count in runs(missing, want):
            try:
                self.map(region, start * self.page_size, want[start], count)
            except DriverError as err:
                errors.append(err)
        return errors

    def _check_mirror_offset(self, mirror: Mirror, offset: int, num_pages: int) -> None:
        self._check_open()
        if offset % self.page_size or num_pages < 1 or offset < 0 or offset + num_pages * self.page_size > mirror.span:
            raise DriverError(f"offset {offset} (+{num_pages} pages of {self.page_size} B) is not page-aligned "
                              f"inside a {mirror.span}-byte mirrored place")
