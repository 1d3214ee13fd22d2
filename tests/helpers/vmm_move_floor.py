"""What one page move costs on the host driver, against the OS calls alone: the floor under the vmm allocator's
share of a step when pages move between slots (docs/performance.md). A move unmaps one page group from a slot and
maps it into another, in every tensor (tiny: 8 tensors of 8 KiB pages, `make run`'s geometry): 16 mmap calls.

    PYTHONPATH=.:tests python tests/helpers/vmm_move_floor.py

Prints the median per move over 200 rounds of 64 moves each, pinned to one core, for the bare libc calls (ctypes,
the same flags) and for `HostVirtualMemory.unmap_mirrored` + `map_mirrored` (checks, books, mapping counts).
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from kvlab.vmm.drivers.host import HostVirtualMemory
from kvlab.vmm.libc import LIBC, MAP_FIXED, MAP_POPULATE, MAP_SHARED, PROT_NONE, PROT_RW, RESERVED

PAGE, TENSORS, PAGES_PER_SLOT, MOVES = 8192, 8, 32, 32


def per_move(move: Callable[[int, int, int], None], rounds: int = 200) -> float:
    """Median seconds per move: each round moves pages 0..MOVES-1 from slot 0 to slot 1 and back."""
    def one_round() -> float:
        t0 = time.perf_counter()
        for a, b in ((0, 1), (1, 0)):
            for j in range(MOVES):
                move(a, b, j)
        return (time.perf_counter() - t0) / (2 * MOVES)
    for _ in range(20):
        one_round()
    return statistics.median(one_round() for _ in range(rounds))


def bare_calls() -> float:
    fd = os.memfd_create("kvlab-move-floor")
    os.ftruncate(fd, TENSORS * MOVES * PAGE)
    span = 2 * PAGES_PER_SLOT * PAGE
    bases = [LIBC.mmap(None, span, PROT_NONE, RESERVED, -1, 0) for _ in range(TENSORS)]
    at = [[base + (slot * PAGES_PER_SLOT) * PAGE for slot in (0, 1)] for base in bases]
    mmap = LIBC.mmap

    def move(a: int, b: int, j: int) -> None:
        for t in range(TENSORS):
            mmap(at[t][a] + j * PAGE, PAGE, PROT_NONE, RESERVED | MAP_FIXED, -1, 0)
        for t in range(TENSORS):
            mmap(at[t][b] + j * PAGE, PAGE, PROT_RW, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, (t * MOVES + j) * PAGE)
    for t in range(TENSORS):
        for j in range(MOVES):
            mmap(at[t][0] + j * PAGE, PAGE, PROT_RW, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, (t * MOVES + j) * PAGE)
    try:
        return per_move(move)
    finally:
        for base in bases:
            LIBC.munmap(base, span)
        os.close(fd)


def driver_calls() -> float:
    driver = HostVirtualMemory(page_size=PAGE)
    span = 2 * PAGES_PER_SLOT * PAGE
    mirror = driver.mirror([(driver.reserve(span), 0) for _ in range(TENSORS)], span, MOVES)
    driver.create_store(TENSORS * MOVES)

    def at(slot: int, j: int) -> int:
        return (slot * PAGES_PER_SLOT + j) * PAGE

    def move(a: int, b: int, j: int) -> None:
        driver.unmap_mirrored(mirror, at(a, j), 1)
        driver.map_mirrored(mirror, at(b, j), j, 1)
    for j in range(MOVES):
        driver.map_mirrored(mirror, at(0, j), j, 1)
    try:
        return per_move(move)
    finally:
        driver.close()


if __name__ == "__main__":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    bare, ours = bare_calls(), driver_calls()
    print(f"one page move, {TENSORS} tensors of {PAGE // 1024} KiB pages ({2 * TENSORS} mmap calls): "
          f"bare libc {bare * 1e6:.1f} us, HostVirtualMemory {ours * 1e6:.1f} us ({ours / bare:.2f}x)")
