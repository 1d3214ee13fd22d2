"""Many SLO searches over one process pool, point by point: each search is a generator of points (slo.search_steps),
and a worker runs one point (one simulated run) at a time, so every worker stays busy while any search has a point
to try, rather than idling while the last whole search runs on another. Each search still tries exactly the
points, in the order, it would alone: the answers are unchanged. A search whose first seed gates others (their warm
starts) is served first."""
from __future__ import annotations

import heapq
import itertools
import queue
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.grid import Saved, optional_bar
from kvlab.experiments.sim.serve.run import ServeSpec, backend_label, run_point
from kvlab.experiments.sim.workers import worker_pool

Steps = Generator[Any, dict[str, Any], Any]


@dataclass(slots=True)
class Search:
    """One search in flight: its job (the checkpoint's key), its steps, how a point becomes a worker's
    arguments, how the finished search is reported, and the point it waits on."""
    job: Any
    steps: Steps
    point_args: Callable[[Any], Any]
    summary: Callable[[Any], dict[str, Any]]
    point: Any = None
    gating: bool = False    # other searches wait on its answer: its points are served first

    def start(self) -> None:
        self.point = next(self.steps)

    def advance(self, result: dict[str, Any]) -> dict[str, Any] | None:
        """Take the point's result; None while the search has another point (now `self.point`), else its
        summary."""
        try:
            self.point = self.steps.send(result)
        except StopIteration as done:
            return self.summary(done.value)
        return None


def run_searches(fn: Callable[[Any], dict[str, Any]], first: list[Search], follow: Callable[[dict], list[Search]],
                 total: int, jobs: int, progress: bool = False, saved: Saved | None = None) -> list[dict]:
    """Every search in `first`, and those `follow(summary)` adds as each finishes; `fn(point_args)` runs one
    point. Completion order. A search `saved` holds is taken from it (its follow-ups added) without running."""
    bar = optional_bar(total, progress, "search", "simulate serve")
    try:
        if jobs <= 1:
            return _Driver(fn, None, 1, follow, bar, saved).run(first)
        with worker_pool(jobs) as pool:
            return _Driver(fn, pool, jobs, follow, bar, saved).run(first)
    finally:
        if bar:
            bar.close()


class _Driver:
    """Keeps up to `jobs` points running, the gating searches' points first."""

    def __init__(self, fn: Callable, pool: Any, jobs: int, follow: Callable, bar: Any, saved: Saved | None) -> None:
        self.fn, self.pool, self.jobs, self.follow, self.bar, self.saved = fn, pool, jobs, follow, bar, saved
        self.ready: list[tuple[bool, int, Search]] = []      # a heap: gating searches, then first come
        self.order = itertools.count()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.running = 0
        self.out: list[dict] = []

    def run(self, first: list[Search]) -> list[dict]:
        self.add(first)
        while self.ready or self.running:
            self.submit_ready()
            self.take(self.next_done())
        return self.out

    def add(self, searches: list[Search]) -> None:
        for search in searches:
            if self.saved and self.saved.key(search.job) in self.saved.checkpoint:
                self.finished(self.saved.checkpoint.get(self.saved.key(search.job)))
            else:
                search.start()
                heapq.heappush(self.ready, (not search.gating, next(self.order), search))

    def submit_ready(self) -> None:
        while self.ready and self.running < self.jobs:
            search = heapq.heappop(self.ready)[2]
            self.running += 1
            args = search.point_args(search.point)
            if self.pool is None:
                self.done.put((search, self.fn(args)))
            else:
                self.pool.apply_async(self.fn, (args,), callback=lambda r, s=search: self.done.put((s, r)),
                                      error_callback=self.done.put)

    def next_done(self) -> tuple[Search, dict[str, Any]]:
        while True:
            try:
                item = self.done.get(timeout=0.5)       # a timeout keeps the wait interruptible by Ctrl-C
            except queue.Empty:
                if self.pool is not None:
                    self.pool.check()                    # a dead worker's result would never come
                continue
            if isinstance(item, BaseException):
                raise item
            self.running -= 1
            return item

    def take(self, item: tuple[Search, dict[str, Any]]) -> None:
        search, result = item
        summary = search.advance(result)
        if summary is None:
            heapq.heappush(self.ready, (not search.gating, next(self.order), search))
            return
        if self.saved:
            self.saved.checkpoint.record(self.saved.key(search.job), summary)
        self.finished(summary)

    def finished(self, summary: dict[str, Any]) -> None:
        self.out.append(summary)
        self.bar and self.bar.update(1)
        self.add(self.follow(summary))


# -- simulate serve's searches: a job tuple (checkpointed by its key) -> its Search ------------------------
def run_one(a: tuple[SimCase, ServeSpec, float, int, int | None, dict[str, float] | None]) -> dict[str, Any]:
    """One point of a search, in a worker."""
    case, spec, rate, seed, max_concurrency, stop = a
    return run_point(case, spec, rate, seed, max_concurrency=max_concurrency, stop_on_miss=stop)


def rate_search(job: tuple[SimCase, ServeSpec, int, dict[str, float], float, float, bool, float | None]
                ) -> Search:
    case, spec, seed, target, start, tol, early_stop, step = job
    stop = target if early_stop else None
    return Search(job, slo.search_steps(target, start, tol, step=step),
                  lambda rate: (case, spec, rate, seed, None, stop), found_summary(case, seed, "slo_rate"))


def concurrency_search(job: tuple[SimCase, ServeSpec, int, dict[str, float], float, float, bool]) -> Search:
    case, spec, seed, target, start, rate, early_stop = job
    stop = target if early_stop else None
    return Search(job, slo.search_int_steps(target, int(start), high_limit=spec.num_requests),
                  lambda n: (case, spec, rate, seed, n, stop), found_summary(case, seed, "slo_max_concurrency"))


def found_summary(case: SimCase, seed: int, key: str) -> Callable[[slo.SearchResult], dict[str, Any]]:
    """What a finished search reports (and the checkpoint keeps)."""
    return lambda found: {"backend": backend_label(case), "seed": seed, key: found.rate,
                          "evaluations": found.evaluations, "runs": list(found.results.values())}
