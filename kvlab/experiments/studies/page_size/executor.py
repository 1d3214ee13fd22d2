"""Where the searches run: `kvlab simulate serve`'s process pool (grid.pool_map), or a Ray cluster with
`--ray ADDRESS` (`local` starts one on this machine). Results come back in the order of the jobs either way, so
a study's output does not depend on where it ran."""
from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.sim.serve.grid import pool_map

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Executor:
    jobs: int = 2
    ray: str | None = None
    progress: bool = True

    def map(self, fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
        if self.ray is None:
            return pool_map(fn, jobs, self.jobs, self.progress, unit="search")
        return ray_map(fn, jobs, self.ray, self.progress)


def check_reachable(address: str) -> None:
    """A HOST:PORT that refuses connections is one line now, not Ray's minutes of retries."""
    host, _, port = address.rpartition(":")
    if address in ("local", "auto") or "://" in address or not port.isdigit():
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


def ray_map(fn: Callable[[Any], Any], jobs: list[Any], address: str, progress: bool) -> list[Any]:
    ray = connect(address)
    task = ray.remote(fn)
    refs = [task.remote(job) for job in jobs]
    bar = _bar(len(refs), progress)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            if bar and done:
                bar.update(len(done))
        return ray.get(refs)
    finally:
        if bar:
            bar.close()


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from kvlab.experiments.reporting.tables import progress_bar
    return progress_bar(total=total, desc="study page-size (ray)", unit="search", leave=False)
