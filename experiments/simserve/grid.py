"""Run many independent points (or SLO searches) in a process pool; Ctrl-C cancels what has not started."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any


def pool_map(fn: Callable[[Any], Any], jobs_args: list[Any], jobs: int, progress: bool = False) -> list[Any]:
    bar = _bar(len(jobs_args), progress)
    out: list[Any] = []
    if jobs <= 1 or len(jobs_args) <= 1:
        for a in jobs_args:
            out.append(fn(a))
            bar and bar.update(1)
    else:
        pool = ProcessPoolExecutor(min(jobs, len(jobs_args)))
        try:
            for r in pool.map(fn, jobs_args):
                out.append(r)
                bar and bar.update(1)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    if bar:
        bar.close()
    return out


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from kvlab.experiments.report import progress_bar
    return progress_bar(total=total, desc="simulate serve", unit="run", leave=False)


def grouped(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out
