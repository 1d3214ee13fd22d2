"""Where the searches run: a local process pool (sim/core.py's worker_pool, as `kvlab simulate serve`'s), or a
Ray cluster with `--ray ADDRESS` (`local` starts one on this machine). Each result is handed to `on_done` as it
finishes (the study's journal), and all come back in the order of the jobs either way, so a study's output does
not depend on where it ran."""
from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import is_digits
from kvlab.experiments.sim.core import worker_pool

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Executor:
    jobs: int = 2
    ray: str | None = None
    progress: bool = True

    def map(self, fn: Callable[[Any], Any], jobs: list[Any], on_done: Callable[[Any], None] | None = None
            ) -> list[Any]:
        done = on_done or (lambda r: None)
        if not jobs:
            return []
        if self.ray is None:
            return pool_map(fn, jobs, self.jobs, self.progress, done)
        return ray_map(fn, jobs, self.ray, self.progress, done)


def _indexed(pair: tuple[Callable[[Any], Any], int, Any]) -> tuple[int, Any]:
    fn, index, job = pair
    return index, fn(job)


def pool_map(fn: Callable[[Any], Any], jobs: list[Any], processes: int, progress: bool,
             on_done: Callable[[Any], None]) -> list[Any]:
    """In the jobs' order; each result reaches `on_done` as soon as it finishes (completion order)."""
    out: list[Any] = [None] * len(jobs)
    bar = _bar(len(jobs), progress, "study page-size")
    try:
        if processes <= 1 or len(jobs) == 1:
            finished = (_indexed((fn, i, job)) for i, job in enumerate(jobs))
            for i, r in finished:
                out[i] = r
                on_done(r)
                bar and bar.update(1)
            return out
        with worker_pool(min(processes, len(jobs))) as pool:
            for i, r in pool.imap_unordered(_indexed, [(fn, i, job) for i, job in enumerate(jobs)]):
                out[i] = r
                on_done(r)
                bar and bar.update(1)
        return out
    finally:
        if bar:
            bar.close()


def check_reachable(address: str) -> None:
    """A HOST:PORT that refuses connections is one line now, not Ray's minutes of retries."""
    host, _, port = address.rpartition(":")
    if address in ("local", "auto") or "://" in address or not is_digits(port):
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at {address!r}: {e}") from None


def connect(address: str) -> Any:
    try:
        import ray
    except ModuleNotFoundError:
        raise ConfigError("--ray needs Ray: pip install 'kvlab[ray]'") from None
    check_reachable(address)
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot reach the Ray cluster at {address!r}: {str(e).splitlines()[0]}") from None
    return ray


def ray_map(fn: Callable[[Any], Any], jobs: list[Any], address: str, progress: bool,
            on_done: Callable[[Any], None]) -> list[Any]:
    ray = connect(address)
    task = ray.remote(fn)
    refs = [task.remote(job) for job in jobs]
    bar = _bar(len(refs), progress, "study page-size (ray)")
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            for r in ray.get(done):
                on_done(r)
            if bar and done:
                bar.update(len(done))
        return ray.get(refs)
    finally:
        if bar:
            bar.close()


def _bar(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from kvlab.experiments.reporting.tables import progress_bar
    return progress_bar(total=total, desc=desc, unit="search", leave=False)
