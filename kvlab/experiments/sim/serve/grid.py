"""Run many independent points in a process pool (the SLO searches run in sim/serve/search_pool.py). Ctrl-C: the
workers ignore SIGINT, the parent terminates them all (simulation.worker_pool) and the CLI exits 130 with one line.
With a Saved (a checkpoint and the key of each job), every finished job is recorded as it finishes and a job the
checkpoint holds is not run again (reporting/checkpoint.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from kvlab.experiments.reporting.checkpoint import Checkpoint
from kvlab.experiments.sim.core import worker_pool


class Saved(NamedTuple):
    checkpoint: Checkpoint
    key: Callable[[Any], str]          # a job's arguments -> the text naming its point


def saved_points(s: Any, total: int, key: Callable[[Any], str], run_only: Sequence[str]) -> Saved | None:
    """A simulate command's checkpoint in its results directory (None with --no-save): `s` is its settings
    dataclass (with save, out, resume, argv); its fields less `run_only` are the configuration a resume must
    match."""
    if not s.save:
        return None
    from kvlab.experiments.reporting.provenance import jsonable
    from kvlab.experiments.reporting.tables import results_dir
    config = jsonable({k: v for k, v in dataclasses.asdict(s).items() if k not in run_only})
    return Saved(Checkpoint(results_dir(s.out), s.argv, config, total, resume=s.resume is not None), key)


def pool_map(fn: Callable[[Any], Any], jobs_args: list[Any], jobs: int, progress: bool = False,
             unit: str = "run", desc: str = "simulate serve", saved: Saved | None = None) -> list[Any]:
    """fn over every job, results in job order; with `saved`, only the jobs it does not hold run."""
    keys = [saved.key(a) for a in jobs_args] if saved else []
    todo = [a for a, k in zip(jobs_args, keys) if k not in saved.checkpoint] if saved else jobs_args
    bar = optional_bar(len(jobs_args), progress, unit, desc)
    if bar:
        bar.update(len(jobs_args) - len(todo))
    try:
        done = _map(fn, todo, jobs, bar, saved)
    finally:                          # an interrupt too: the bar's line is cleared before the error line
        if bar:
            bar.close()
    return [saved.checkpoint.get(k) for k in keys] if saved else done


def _map(fn: Callable[[Any], Any], jobs_args: list[Any], jobs: int, bar: Any, saved: Saved | None) -> list[Any]:
    out: list[Any] = []

    def finished(a: Any, r: Any) -> None:
        out.append(r)
        if saved:
            saved.checkpoint.record(saved.key(a), r)
        bar and bar.update(1)
    if jobs <= 1 or len(jobs_args) <= 1:
        for a in jobs_args:
            finished(a, fn(a))
        return out
    with worker_pool(min(jobs, len(jobs_args))) as pool:
        for a, r in zip(jobs_args, pool.imap(fn, jobs_args)):
            finished(a, r)
    return out


def optional_bar(total: int, enabled: bool, unit: str, desc: str) -> Any:
    if not enabled:
        return None
    from kvlab.experiments.reporting.tables import progress_bar
    return progress_bar(total=total, desc=desc, unit=unit, leave=False)


def grouped(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out
