"""What one page move costs on the host driver, against the OS calls alone: the floor under the vmm allocator's
share of a step when pages move between slots (docs/performance.md). A move unmaps one page group from a slot and
maps it into another, in every tensor (tiny: 8 tensors of 8 KiB pages, `make run`'s geometry): 16 mmap calls.

    PYTHONPATH=.:tests python tests/helpers/vmm_move_floor.py

Prints the median per move over 200 rounds of 64 moves each, pinned to one core, for the bare libc calls (ctypes,
the same flags) and for `HostVirtualMemory.unmap_mirrored` + `map_mirrored` (checks, books, mapping counts). Then
the bare calls again with a second core busy multiplying matrices, in another process and in a thread of this one:
a thread shares the address space, so every unmap or replacing map must also flush that core's TLB (an
inter-processor interrupt, costly in a VM); another process's core needs no flush. That is the price of page moves
while torch runs two threads, or while the background mapper moves pages beside the forward pass.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator

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


def spin(stop: Callable[[], bool], core: int) -> None:
    """Keep `core` busy in torch (which releases the GIL) until `stop()`."""
    import torch
    torch.set_num_threads(1)
    os.sched_setaffinity(threading.get_native_id(), {core})
    a = torch.randn(256, 256)
    while not stop():
        a @ a


def spin_forever(core: int) -> None:
    spin(lambda: False, core)


def other_core_busy(core: int, kind: str) -> contextlib.AbstractContextManager[None]:
    """`core` busy for the block: in another process ('process') or in a thread of this one ('thread')."""
    return busy_in_process(core) if kind == "process" else busy_in_thread(core)


@contextlib.contextmanager
def busy_in_process(core: int) -> Iterator[None]:
    proc = multiprocessing.get_context("spawn").Process(target=spin_forever, args=(core,), daemon=True)
    proc.start()
    time.sleep(2.0)                             # the child imports torch before it spins
    try:
        yield
    finally:
        proc.kill()
        proc.join()


@contextlib.contextmanager
def busy_in_thread(core: int) -> Iterator[None]:
    done = threading.Event()
    thread = threading.Thread(target=spin, args=(done.is_set, core), daemon=True)
    thread.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        done.set()
        thread.join()


if __name__ == "__main__":
    mine, *others = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {mine})
    bare, ours = bare_calls(), driver_calls()
    print(f"one page move, {TENSORS} tensors of {PAGE // 1024} KiB pages ({2 * TENSORS} mmap calls): "
          f"bare libc {bare * 1e6:.1f} us, HostVirtualMemory {ours * 1e6:.1f} us ({ours / bare:.2f}x)")
    if not others:
        print("one core only: no second core to keep busy")
    for kind in ("process", "thread") if others else ():
        with other_core_busy(others[0], kind):
            busy = bare_calls()
        print(f"bare libc with core {others[0]} busy in another {kind}: {busy * 1e6:.1f} us ({busy / bare:.2f}x)")
