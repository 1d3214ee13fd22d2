"""Samples a kvlab server's GET /kvlab/stats every ~0.2 s in a thread while a load run goes on: the KV utilisation,
the running batch and (on a shared pool) the engine's bytes over time, for the sweep's and the multi-model plots."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

SAMPLE_EVERY_S = 0.2
FIELDS = ("running", "waiting", "swapped", "kv_usage_ratio", "kv_utilization", "kv_units_used")
POOL_FIELDS = ("total_bytes", "used_bytes", "engine_bytes")     # the `pool` block's, as pool_<name> (None: no pool)


class Ticker:
    """Calls `tick()` every `every_s` seconds on a daemon thread from `start()`, and once more at `stop()` (the
    state at a run's end: a short run has one point at least)."""

    def __init__(self, tick: Callable[[], None], every_s: float, name: str) -> None:
        self.tick, self.every_s = tick, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.every_s)
        self.tick()


class StatsSampler:
    """`with StatsSampler(url) as s: ...` then `s.series`: {"t": [s since start], field: [...]}; a poll that fails
    is counted in `s.errors` and skipped (the server answers other requests meanwhile)."""

    def __init__(self, base_url: str, every_s: float = SAMPLE_EVERY_S, t0: float | None = None) -> None:
        self.url = base_url.rstrip("/") + "/kvlab/stats"
        self.every_s = every_s
        self.t0 = t0                # the time.perf_counter() that t = 0 means (default: when sampling starts)
        self.series: dict[str, list[float]] = {k: [] for k in ("t", *FIELDS, *(f"pool_{f}" for f in POOL_FIELDS))}
        self.errors = 0
        self._ticker = Ticker(self._sample, every_s, "kvlab-stats-sampler")

    def __enter__(self) -> StatsSampler:
        self._client = httpx.Client(timeout=5)
        self.t0 = time.perf_counter() if self.t0 is None else self.t0
        self._ticker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ticker.stop()
        self._client.close()

    def _sample(self) -> None:
        try:
            stats = self._client.get(self.url).json()
        except (httpx.HTTPError, ValueError):
            self.errors += 1
            return
        if stats:                                    # {} before the server's first engine step
            self.series["t"].append(round(time.perf_counter() - self.t0, 4))
            for k in FIELDS:
                self.series[k].append(stats.get(k))
            pool = stats.get("pool") or {}
            for k in POOL_FIELDS:
                self.series[f"pool_{k}"].append(pool.get(k))
