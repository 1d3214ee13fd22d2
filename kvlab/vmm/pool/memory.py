"""The host memory calls of a pool: punch pages' memory back to the OS, as runs of consecutive pages."""
from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Iterator

from kvlab.vmm.libc import LIBC, PUNCH_HOLE
from kvlab.vmm.pool.errors import PoolError


def failed(what: str) -> PoolError:
    err = ctypes.get_errno()
    return PoolError(f"{what} failed: {os.strerror(err)} (errno {err})")


def runs(pages: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Sorted page ids as (first, count) runs of consecutive ids."""
    first = count = None
    for page in sorted(pages):
        if first is not None and page == first + count:
            count += 1
            continue
        if first is not None:
            yield first, count
        first, count = page, 1
    if first is not None:
        yield first, count


def punch(fd: int, page_size: int, pages: Iterable[int]) -> None:
    """Give the pages' memory back to the OS; the next reader of them sees zeros."""
    for first, count in runs(pages):
        if LIBC.fallocate(fd, PUNCH_HOLE, first * page_size, count * page_size) != 0:
            raise failed(f"punching {count} pool pages at page {first}")
