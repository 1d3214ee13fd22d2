"""The server's /metrics: one prometheus_client registry per server (no global state), written by the engine
thread after each step and at each finish, read by the HTTP thread.

Engine per-step records are bounded: every RESET_STEPS steps the engine's recorder is folded into running
totals here and reset, so a server that runs for days keeps constant memory.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

RESET_STEPS = 4096
READ_EVERY_S = 0.2
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
COUNTED = ("preemptions", "recomputed_tokens", "num_steps")
CACHE_COUNTED = ("map_calls", "unmap_calls", "map_seconds", "unmap_seconds")


class ServerMetrics:
    def __init__(self, backend: str) -> None:
        self.registry = r = CollectorRegistry()
        g = lambda name, doc: Gauge("kvlab_" + name, doc, registry=r)
        self.running = g("num_requests_running", "sequences holding KV and decoding")
        self.waiting = g("num_requests_waiting", "sequences waiting for admission")
        self.swapped = g("num_requests_swapped", "sequences swapped out to host memory")
        self.kv_used = g("kv_units_used", "KV allocation units in use")
        self.kv_total = g("kv_units_total", "KV allocation units in the budget")
        self.kv_util = g("kv_utilization", "live tokens / allocated token slots")
        self.kv_usage = g("kv_usage_ratio", "used units / total units")
        self.counts = {k: g(k + "_total", f"cumulative {k.replace('_', ' ')}") for k in COUNTED}
        self.cache_counts = {k: g(k + "_total", f"cumulative {k.replace('_', ' ')}") for k in CACHE_COUNTED}
        c = lambda name, doc: Counter("kvlab_" + name, doc, registry=r)
        self.finished = c("requests_finished", "requests that finished")
        self.failed = c("requests_failed", "requests that failed alone")
        self.aborted = c("requests_aborted", "requests aborted (client gone or server stopping)")
        self.output_tokens = c("generation_tokens", "output tokens of finished requests")
        self.prompt_tokens = c("prompt_tokens", "prompt tokens of finished requests")
        h = lambda name, doc: Histogram("kvlab_" + name, doc, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = h("time_to_first_token_seconds", "arrival to first token (engine clock)")
        self.tpot = h("time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1)")
        self.e2e = h("e2e_request_latency_seconds", "arrival to finish (engine clock)")
        Gauge("kvlab_backend_info", "the KV backend", ["backend"], registry=r).labels(backend).set(1)
        self.base = dict.fromkeys(COUNTED, 0)
        self.last_read = 0.0
        self.latest: dict[str, float] = {}         # GET /kvlab/stats: the last step's gauges (replaced whole)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def stats(self) -> dict[str, float]:
        """The gauges after the last step, as JSON-ready numbers (cheaper to poll than /metrics)."""
        return dict(self.latest)

    def on_step(self, engine: Any, running: int, waiting: int, swapped: int, force: bool = False) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.swapped.set(swapped)
        s = engine.cache_stats()
        self.kv_used.set(s.used_units)
        self.kv_total.set(s.total_units)
        usage = s.used_units / s.total_units if s.total_units else 0.0
        util = s.live_tokens / s.allocated_token_slots if s.allocated_token_slots else 0.0
        self.kv_usage.set(usage)
        self.kv_util.set(util)
        for k, gauge in self.cache_counts.items():
            gauge.set(getattr(s, k))
        self.latest = {"running": running, "waiting": waiting, "swapped": swapped, "kv_units_used": s.used_units,
                       "kv_units_total": s.total_units, "kv_usage_ratio": usage,
                       "kv_utilization": util}
        now = time.monotonic()
        if now - self.last_read < READ_EVERY_S and not force:
            return
        self.last_read = now
        m = engine.metrics()                       # computes percentiles: read a few times a second, not per step
        for k, gauge in self.counts.items():
            gauge.set(self.base[k] + getattr(m, k))
        if m.num_steps >= RESET_STEPS:
            for k in COUNTED:
                self.base[k] += getattr(m, k)
            engine.reset_metrics()

    def on_finished(self, out: Any, now: float) -> None:
        if out.error is not None:
            self.failed.inc()
            return
        self.finished.inc()
        n_out = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
        self.output_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        end = m.finished_time if m.finished_time is not None else now
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.e2e.observe(end - m.arrival_time)
        if n_out > 1:
            self.tpot.observe((end - m.first_token_time) / (n_out - 1))

    def on_abort(self) -> None:
        self.aborted.inc()
