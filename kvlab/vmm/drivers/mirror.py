"""Putting mirrored places back together (vmm/drivers/base.py maps them in lockstep): after a mirrored call fails,
`undo` returns every place to what it mapped before, all or nothing; only when that fails too are the places
left apart, and `TornMirror` says so. `clear` is the way out: it unmaps whatever any place still maps there.
"""
from __future__ import annotations

import logging

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.types import Books, Region, TornMirror, runs

log = logging.getLogger("kvlab.vmm")

Before = list[tuple[Region, int, dict[int, int]]]   # (range, first VA page, VA page -> store page it mapped)


class MirrorRepair:
    """Composed into a driver: repairs go through its checked, booked `map` and `unmap`."""

    def __init__(self, driver: Books) -> None:
        self.driver = driver

    def undo(self, exc: BaseException, call: str, offset: int, num_pages: int, before: Before) -> None:
        """Put every place's pages [va, +num_pages) back as `before` says (absent: unmapped). Returns if that
        worked (the caller re-raises `exc`); raises TornMirror naming both failures if not."""
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

    def clear(self, places: list[tuple[Region, int]], offset: int, num_pages: int) -> None:
        """Unmap whatever is mapped at VA pages [va, +num_pages) of each (range, va); tries every place, raises
        TornMirror if some unmap still fails."""
        errors = []
        for region, va in places:
            errors += self._restore(region, va, num_pages, {})
        if errors:
            raise TornMirror(f"clearing {num_pages} page(s) at offset {offset} of {len(places)} mirrored places "
                             f"failed ({errors[0]}); close the cache") from errors[0]

    def _restore(self, region: Region, va: int, num_pages: int, want: dict[int, int]) -> list[DriverError]:
        """Unmap what should not be mapped in [va, +num_pages), then map what is missing; try all, return failures."""
        errors: list[DriverError] = []
        driver, have = self.driver, region.mapped
        extra = [i for i in range(va, va + num_pages) if i in have and have[i] != want.get(i)]
        for start, count in runs(extra):
            try:
                driver.unmap(region, start * driver.page_size, count)
            except DriverError as err:
                errors.append(err)
        missing = [i for i in range(va, va + num_pages) if i in want and i not in have]
        for start, count in runs(missing, want):
            try:
                driver.map(region, start * driver.page_size, want[start], count)
            except DriverError as err:
                errors.append(err)
        return errors
