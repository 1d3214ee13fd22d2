"""Releasing a range and closing a driver past failures: every unmap is tried (those that fail once more page
by page), every range is freed, and then one `DriverError` sums up what failed and what is still held.
"""
from __future__ import annotations

import logging

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.types import Books, Region, runs

log = logging.getLogger("kvlab.vmm")


class Teardown:
    """`release` and `close` of a driver (vmm/drivers/base.py), built on its `unmap` and its OS calls (`os`)."""

    def __init__(self, driver: Books) -> None:
        self.driver = driver

    def release(self, region: Region) -> None:
        """Unmap what is still mapped and free the reservation. Refused while a tensor view of it is alive.
        Every unmap is tried (those that fail once again page by page) and the range is freed even when some
        fail; then one DriverError sums up what failed and what is still held."""
        if region.released:
            return
        live = self.driver.live_views(region)
        if live:
            raise DriverError(f"{live} tensor view(s) of the range at {region.base:#x} are still alive; "
                              "drop every view before releasing it")
        errors = self._release(region)
        if errors:
            held = ("the range was released in the end" if region.released else
                    f"the range is still reserved with {len(region.pages)} page(s) mapped")
            raise self._summary(f"releasing the range at {region.base:#x}", errors, held)

    def _release(self, region: Region) -> list[DriverError]:
        errors = self._unmap_all(region)
        try:
            self.driver.os.release(region)
        except DriverError as exc:
            return errors + [exc]
        for start, count in runs(sorted(region.pages)):   # still mapped after failed unmaps: gone with the range
            self.driver._book_unmap(region, start, count, 0)
        region.released = True
        self.driver.regions.remove(region)
        self.driver.stats.reserved_bytes -= region.nbytes
        self.driver.mappings.add(-region.vmas)
        return errors

    def _unmap_all(self, region: Region) -> list[DriverError]:
        """Unmap every mapped run; then try what is left once more, page by page, so one page that keeps failing
        leaves only itself mapped. Returns the failures."""
        errors: list[DriverError] = []
        unmap = self.driver._unmap if self.driver.closed else self.driver.unmap   # closed: a deferred release
        for start, count in runs(sorted(region.mapped)):
            try:
                unmap(region, start * self.driver.page_size, count)
            except DriverError as exc:
                errors.append(exc)
        left = sorted(region.pages)
        if left:
            self.driver.stats.release_retries += 1
            log.warning("releasing the range at %#x: %d page(s) failed to unmap (%s); trying them once more, page "
                        "by page", region.base, len(left), errors[0])
        for i in left:
            try:
                unmap(region, i * self.driver.page_size)
            except DriverError as exc:
                errors.append(exc)
        return errors

    @staticmethod
    def _summary(what: str, errors: list[DriverError], held: str) -> DriverError:
        """One line for several failures: how many, the distinct messages, and what is still held."""
        messages = list(dict.fromkeys(str(e) for e in errors))
        shown = "; ".join(messages[:3]) + (f"; and {len(messages) - 3} more" if len(messages) > 3 else "")
        exc = DriverError(f"{what}: {len(errors)} driver call(s) failed ({shown}); {held}")
        exc.__cause__ = errors[0]
        return exc

    def close(self) -> None:
        """Release every range and the page store. Idempotent, and always completes: a range a tensor view still reads
        (a caller's, or one an interrupted call's traceback keeps) stays mapped until its last view dies and is
        released then (logged, counted in `deferred_releases`), so closing never pulls memory from under a view.
        Goes on past failures and then raises one DriverError that sums them up."""
        driver = self.driver
        if driver.closed:
            return
        driver.live_views()   # collects views kept only by reference cycles
        errors, deferred = [], [region for region in driver.regions if region.live_views]
        for region in deferred:
            region.orphan_release = self._release_orphan
        for region in [region for region in driver.regions if not region.live_views]:
            errors += self._release(region)   # keep releasing the rest, then report every failure at once
        if deferred:   # e.g. closed while an interrupted call's traceback keeps its views: expected, counted
            driver.stats.deferred_releases += len(deferred)
            log.info("closing the %s virtual-memory driver: %d range(s) a tensor view still reads are released when "
                     "their last view is dropped", driver.name, len(deferred))
        try:
            driver.os.close(driver.store_maps)
        except DriverError as exc:
            errors.append(exc)
        driver.closed = True
        if errors:
            ranges, pages = len(driver.regions), driver.stats.mapped_pages
            held = (f"still held: {ranges} range(s) with {pages} mapped page(s)" if ranges or pages
                    else "every range was released in the end")
            raise self._summary(f"closing the {driver.name} virtual-memory driver", errors, held)

    def _release_orphan(self, region: Region) -> None:
        """The last view of a range close() deferred is gone (called from a finalizer: log, never raise)."""
        try:
            errors = self._release(region)
        except Exception as exc:  # noqa: BLE001 - a finalizer must not raise; the failure is logged
            errors = [exc]
        if errors:
            log.error("releasing the range at %#x after its last view died: %d driver call(s) failed (%s)",
                      region.base, len(errors), errors[0])
