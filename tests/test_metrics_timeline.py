"""The per-step timeline is a ring buffer: an engine never reset holds bounded memory (issue 18.8b), and a run
shorter than the bound reports exactly what it did before."""
from __future__ import annotations

import tracemalloc

from kvlab.common.kv.types import CacheStats
from kvlab.common.metrics import TIMELINE_LIMIT, MetricsRecorder
from kvlab.common.request import SchedulerOutput, SchedulerStats


class StubCache:
    """The two calls the recorder makes; live tokens follow the step count so rows can be told apart."""

    def __init__(self) -> None:
        self.step = 0

    def stats(self) -> CacheStats:
        return CacheStats("stub", "block", 16, 100, 10, 90, live_tokens=self.step % 50, allocated_token_slots=64)

    def kernel_report(self) -> dict:
        return {}


def run_steps(recorder: MetricsRecorder, cache: StubCache, steps: int, first: int = 0) -> None:
    out = SchedulerOutput()
    for i in range(first, first + steps):
        cache.step = i
        recorder.on_step(float(i), i + 0.5, out, running=1 + i % 3, scheduler_seconds=0.0, s=cache.stats())


def test_100k_steps_keep_the_timeline_bounded():
    cache = StubCache()
    recorder = MetricsRecorder(cache, timeline_limit=1000)
    tracemalloc.start()
    try:
        run_steps(recorder, cache, 10_000)
        settled = tracemalloc.get_traced_memory()[0]
        run_steps(recorder, cache, 90_000, first=10_000)
        grown = tracemalloc.get_traced_memory()[0] - settled
    finally:
        tracemalloc.stop()
    assert grown < 200_000, f"the recorder grew {grown} B over 90k steps"     # unbounded: ~10 MB
    m = recorder.result("stub", SchedulerStats())
    assert m.num_steps == 100_000 and m.timeline_dropped == 99_000
    assert all(len(v) == 1000 for v in m.timeline.values())
    assert m.timeline["time"][0] == 99_000.5 and m.timeline["time"][-1] == 99_999.5    # the last 1000 steps
    assert m.mean_batch == sum(1 + i % 3 for i in range(100_000)) / 100_000           # summaries cover all steps
    assert m.max_batch == 3


def test_a_run_shorter_than_the_bound_keeps_every_row():
    cache = StubCache()
    recorder = MetricsRecorder(cache, timeline_every=2)
    run_steps(recorder, cache, 501)
    m = recorder.result("stub", SchedulerStats())
    assert TIMELINE_LIMIT > 501 and m.timeline_dropped == 0
    assert m.timeline["time"] == [i + 0.5 for i in range(1, 501, 2)]
    assert m.timeline["live_tokens"] == [i % 50 for i in range(1, 501, 2)]
    assert isinstance(m.timeline["running"], list)                  # plain lists, as bench and the JSON expect
