"""Run many independent points (or SLO searches) in a process pool. Ctrl-C: the workers ignore SIGINT, the parent
terminates them all (simulation.worker_pool) and the CLI exits 130 with one line."""
from __future__ import annotations

import queue
from collections.abc import Callable, Iterable
from typing import Any

from kvlab.experiments.sim.core import worker_pool


def pool_map(fn: Callable[[Any], Any], jobs_args: list[Any], jobs: int, progress: bool = False,
             unit: str = "run") -> list[Any]:
    bar = _bar(len(jobs_args), progress, unit)
    try:
        return _map(fn, jobs_args, jobs, bar)
    finally:                          # an interrupt too: the bar's line is cleared before the error line
        if bar:
            bar.close()


def _map(fn: Callable[[Any], Any], jobs_args: list[Any], jobs: int, bar: Any) -> list[Any]:
    out: list[Any] = []
    if jobs <= 1 or len(jobs_args) <= 1:
        for a in jobs_args:
            out.append(fn(a))
            bar and bar.update(1)
        return out
    with worker_pool(min(jobs, len(jobs_args))) as pool:
        for r in pool.imap(fn, jobs_args):
            out.append(r)
            bar and bar.update(1)
    return out


def pool_chain(fn: Callable[[Any], Any], first: list[Any], follow: Callable[[Any], list[Any]], total: int,
               jobs: int, progress: bool = False, unit: str = "search") -> list[Any]:
    """Run `first`; each result r adds the jobs `follow(r)`, which start as soon as a worker is free (no
    barrier between the two kinds). `total`: every job expected, for the progress bar. Completion order."""
    bar = _bar(total, progress, unit)
    try:
        if jobs <= 1:
            return _chain_serial(fn, first, follow, bar)
        with worker_pool(jobs) as pool:
            return _chain_pool(pool, fn, first, follow, bar)
    finally:
        if bar:
            bar.close()


def _chain_serial(fn: Callable, first: list[Any], follow: Callable, bar: Any) -> list[Any]:
    out, todo = [], list(first)
    while todo:
        r = fn(todo.pop(0))
        out.append(r)
        todo.extend(follow(r))
        bar and bar.update(1)
    return out


def _chain_pool(pool: Any, fn: Callable, first: list[Any], follow: Callable, bar: Any) -> list[Any]:
    done: queue.SimpleQueue = queue.SimpleQueue()
    out: list[Any] = []
    pending = 0
    for a in first:
        pool.apply_async(fn, (a,), callback=done.put, error_callback=done.put)
        pending += 1
    while pending:
        try:
            r = done.get(timeout=0.5)       # a timeout keeps the wait interruptible by Ctrl-C
        except queue.Empty:
            continue
        pending -= 1
        if isinstance(r, BaseException):
            raise r
        out.append(r)
        bar and bar.update(1)
        for a in follow(r):
            pool.apply_async(fn, (a,), callback=done.put, error_callback=done.put)
            pending += 1
    return out


def _bar(total: int, enabled: bool, unit: str) -> Any:
    if not enabled:
        return None
    from kvlab.experiments.reporting.tables import progress_bar
    return progress_bar(total=total, desc="simulate serve", unit=unit, leave=False)


def grouped(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out
