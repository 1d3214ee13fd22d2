"""Per-run metrics, measured the same way for every backend and runner (times on the runner's clock).

RunMetrics is the run record: bench writes it, the simulator's rows extend it (SimRow) and the server's /metrics
names come from its names (docs/run-record.md); one quantity, one name.

KV utilisation is live tokens / allocated token slots, averaged over steps. Waste per step is allocated - live
token slots, split into reserved waste (slots held for tokens a sequence will still produce: backends that
reserve ahead of need report it as stats().extra["reserved_waste_tokens"]) and internal waste (the rest:
partial blocks/pages, reservations beyond the final length).

The per-step timeline keeps the last `timeline_limit` recorded rows (a ring buffer; every mean and peak above
is a running summary over all steps), so an engine that is never reset holds bounded memory.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.kv.types import CacheStats
    from kvlab.common.request import Request, SchedulerOutput, SchedulerStats

TIMELINE_FIELDS = ("time", "running", "batch", "tokens", "live_tokens", "allocated_token_slots", "used_units",
                   "mapped_bytes")
TIMELINE_LIMIT = 100_000     # rows kept (~110 B each, ~11 MB); longer runs keep their last TIMELINE_LIMIT rows


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@dataclass(slots=True)
class RunMetrics:
    backend: str
    num_requests: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_seconds: float = 0.0
    output_tokens_per_s: float = 0.0
    total_tokens_per_s: float = 0.0            # (prompt + output tokens) / wall time, as vLLM's benchmark
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p90: float | None = None
    tpot_p99: float | None = None
    mean_batch: float = 0.0                    # running sequences per step
    max_batch: int = 0
    kv_utilization: float = 0.0                # live tokens / allocated token slots, mean over steps
    mean_live_tokens: float = 0.0
    mean_allocated_token_slots: float = 0.0
    mean_reserved_waste_tokens: float = 0.0
    mean_internal_waste_tokens: float = 0.0
    unit_name: str = ""
    tokens_per_unit: int = 0
    total_units: int = 0
    peak_used_units: int = 0
    peak_mapped_bytes: int = 0
    preemptions: int = 0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    fork_fallbacks: int = 0
    computed_tokens: int = 0                   # prompt, recompute and decode tokens run through the model
    allocator_seconds: float = 0.0
    allocator_share: float = 0.0               # of the summed step time
    scheduler_seconds: float = 0.0             # wall time in schedule() + update()
    kernels: dict[str, str] = field(default_factory=dict)
    refused_kernels: list[dict[str, Any]] = field(default_factory=list)
    kernel_fallbacks: list[dict[str, str]] = field(default_factory=list)
    num_steps: int = 0
    timeline: dict[str, list] = field(default_factory=dict)
    timeline_dropped: int = 0                  # oldest timeline rows dropped to keep it bounded

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        """Every figure as plain data; the per-step timeline (one entry per step) only when asked."""
        d = dataclasses.asdict(self)
        if not timeline:
            d.pop("timeline")
        return d


class MetricsRecorder:
    """Accumulates one run: call start(), on_step() after every engine step, on_finished() per request,
    then result()."""

    def __init__(self, cache: KVCache, timeline_every: int = 1, timeline_limit: int = TIMELINE_LIMIT) -> None:
        self.cache = cache
        self.timeline_every = max(1, timeline_every)
        self.timeline_limit = max(1, timeline_limit)
        self.start(0.0, None)

    def start(self, now: float, sched: SchedulerStats | None) -> None:
        self.t0 = self.t_last = now
        self.sched0 = dataclasses.replace(sched) if sched is not None else None
        s = self.cache.stats()
        self.stats0 = s
        self.steps = 0
        self.step_seconds = 0.0
        self.scheduler_seconds = 0.0
        self.sum_running = self.sum_util = self.sum_live = self.sum_alloc = self.sum_reserved = 0.0
        self.util_steps = 0
        self.max_running = self.peak_used = self.peak_mapped = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.num_requests = self.num_failed = 0
        self.timeline: dict[str, deque] = {k: deque(maxlen=self.timeline_limit) for k in TIMELINE_FIELDS}
        self.timeline_rows = 0

    def on_step(self, t_start: float, t_end: float, out: SchedulerOutput, running: int,
                scheduler_seconds: float, s: CacheStats) -> None:
        """`s`: the cache's stats after the step (the engine reads them once per step for every consumer)."""
        self.steps += 1
        self.t_last = t_end
        self.step_seconds += t_end - t_start
        self.scheduler_seconds += scheduler_seconds
        self.sum_running += running
        self.max_running = max(self.max_running, running)
        self.sum_live += s.live_tokens
        self.sum_alloc += s.allocated_token_slots
        self.sum_reserved += s.extra.get("reserved_waste_tokens", 0)
        if s.allocated_token_slots:
            self.sum_util += s.live_tokens / s.allocated_token_slots
            self.util_steps += 1
        self.peak_used = max(self.peak_used, s.used_units)
        self.peak_mapped = max(self.peak_mapped, s.mapped_bytes)
        if self.steps % self.timeline_every == 0:
            row = (t_end, running, len(out.items), out.num_tokens, s.live_tokens, s.allocated_token_slots,
                   s.used_units, s.mapped_bytes)
            for key, value in zip(TIMELINE_FIELDS, row):
                self.timeline[key].append(value)
            self.timeline_rows += 1

    def on_finished(self, req: Request) -> None:
        self.num_requests += 1
        if req.error is not None:
            self.num_failed += 1
            return
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival_time)
        for seq in req.seqs:
            n = seq.num_output_tokens
            if n > 1 and seq.first_token_time is not None and seq.last_token_time is not None:
                self.tpot.append((seq.last_token_time - seq.first_token_time) / (n - 1))

    def result(self, backend: str, sched: SchedulerStats) -> RunMetrics:
        s, s0 = self.cache.stats(), self.stats0
        d = _delta(sched, self.sched0)
        wall = self.t_last - self.t0
        steps = max(self.steps, 1)
        alloc = s.allocator_seconds - s0.allocator_seconds
        report = self.cache.kernel_report()
        m = RunMetrics(
            backend=backend, num_requests=self.num_requests, num_failed=self.num_failed,
            prompt_tokens=d["prompt_tokens"], output_tokens=d["output_tokens"], wall_seconds=wall,
            output_tokens_per_s=d["output_tokens"] / wall if wall > 0 else 0.0,
            total_tokens_per_s=(d["prompt_tokens"] + d["output_tokens"]) / wall if wall > 0 else 0.0,
            mean_batch=self.sum_running / steps, max_batch=self.max_running,
            kv_utilization=self.sum_util / self.util_steps if self.util_steps else 0.0,
            mean_live_tokens=self.sum_live / steps, mean_allocated_token_slots=self.sum_alloc / steps,
            mean_reserved_waste_tokens=self.sum_reserved / steps,
            mean_internal_waste_tokens=(self.sum_alloc - self.sum_live - self.sum_reserved) / steps,
            unit_name=s.unit_name, tokens_per_unit=s.tokens_per_unit, total_units=s.total_units,
            peak_used_units=self.peak_used, peak_mapped_bytes=self.peak_mapped,
            preemptions=d["preemptions"], recompute_preemptions=d["recompute_preemptions"],
            swap_preemptions=d["swap_preemptions"], recomputed_tokens=d["recomputed_tokens"],
            swapped_out_bytes=s.swapped_out_bytes - s0.swapped_out_bytes,
            swapped_in_bytes=s.swapped_in_bytes - s0.swapped_in_bytes,
            fork_fallbacks=d["fork_fallbacks"], computed_tokens=d["computed_tokens"],
            allocator_seconds=alloc,
            allocator_share=alloc / self.step_seconds if self.step_seconds > 0 else 0.0,
            scheduler_seconds=self.scheduler_seconds,
            kernels=dict(report.get("kernels", {})), refused_kernels=list(report.get("refused", [])),
            kernel_fallbacks=list(report.get("runtime_fallbacks", [])), num_steps=self.steps,
            timeline={k: list(v) for k, v in self.timeline.items()},
            timeline_dropped=self.timeline_rows - len(self.timeline["time"]),
        )
        for q in (50, 90, 99):
            setattr(m, f"ttft_p{q}", percentile(self.ttft, q))
            setattr(m, f"tpot_p{q}", percentile(self.tpot, q))
        return m


def _delta(now: SchedulerStats, then: SchedulerStats | None) -> dict[str, int]:
    a = dataclasses.asdict(now)
    if then is None:
        return a
    b = dataclasses.asdict(then)
    return {k: a[k] - b[k] for k in a}
