"""The server's /metrics: one prometheus_client registry per server (no global state), written by the engine
thread after each step and at each finish, read by the HTTP thread.

Every metric is one row of METRICS, named by the run record (common/metrics.py: RunMetrics, the cache's
CacheStats, the scheduler's queues) and exported as `kvlab_` + that name + its unit (+ `_total` for a counter),
or under vLLM's name where vLLM has one. A row's `old` name is exported too for one release (docs/run-record.md).

Engine per-step records are bounded: every RESET_STEPS steps the engine's recorder is folded into running
totals here and reset, so a server that runs for days keeps constant memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

RESET_STEPS = 4096
READ_EVERY_S = 1.0         # the run record's counts, while stepping: building the record takes milliseconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
COUNTED = ("preemptions", "recomputed_tokens", "num_steps")                  # RunMetrics, since the last reset
CACHE_COUNTED = ("map_calls", "unmap_calls", "map_seconds", "unmap_seconds")  # CacheStats, since the start
# Engine.handoff.stats.to_dict() key -> its counter (since the start); GET /kvlab/stats has them under "handoff"
HANDOFF_COUNTED = {"count": "handoffs", "bytes_copied": "handoff_bytes_copied", "units_moved": "handoff_units_moved",
                   "seconds": "handoff_seconds", "failed": "handoffs_failed", "expired": "handoffs_expired"}


@dataclass(frozen=True, slots=True)
class Exported:
    name: str                 # the record's name; also the key in GET /kvlab/stats for a gauge
    kind: type                # Gauge | Counter | Histogram
    help: str
    unit: str = ""            # the Prometheus unit suffix, unless the name already ends with it
    vllm: str = ""            # vLLM's name for it, used instead of the derived one
    old: str = ""             # the name exported before the shared record (one more release)

    @property
    def prom_name(self) -> str:
        if self.vllm:
            return "kvlab_" + self.vllm
        unit = f"_{self.unit}" if self.unit and not self.name.endswith(self.unit) else ""
        return f"kvlab_{self.name}{unit}"       # prometheus_client adds a counter's _total

    @property
    def prom_names(self) -> tuple[str, ...]:
        return (self.prom_name, "kvlab_" + self.old) if self.old else (self.prom_name,)


METRICS = (
    Exported("running", Gauge, "sequences holding KV and decoding", vllm="num_requests_running"),
    Exported("waiting", Gauge, "sequences waiting for admission", vllm="num_requests_waiting"),
    Exported("swapped", Gauge, "sequences swapped out to host memory", vllm="num_requests_swapped"),
    Exported("used_units", Gauge, "KV allocation units in use", old="kv_units_used"),
    Exported("total_units", Gauge, "KV allocation units in the budget", old="kv_units_total"),
    Exported("mapped_bytes", Gauge, "bytes of KV memory mapped (vmm: freed slots' parked pages included)"),
    Exported("kv_usage_ratio", Gauge, "used units / total units", unit="ratio"),
    Exported("kv_utilization", Gauge, "live tokens / allocated token slots", unit="ratio", old="kv_utilization"),
    Exported("preemptions", Counter, "cumulative preemptions"),
    Exported("recomputed_tokens", Counter, "cumulative tokens recomputed after a preemption"),
    Exported("num_steps", Counter, "cumulative engine steps"),
    Exported("map_calls", Counter, "cumulative map calls"),
    Exported("unmap_calls", Counter, "cumulative unmap calls"),
    Exported("map_seconds", Counter, "cumulative seconds in map calls", unit="seconds"),
    Exported("unmap_seconds", Counter, "cumulative seconds in unmap calls", unit="seconds"),
    Exported("pool_total_bytes", Gauge, "bytes in the machine-wide KV page pool (0: no pool)"),
    Exported("pool_used_bytes", Gauge, "bytes of the pool held by all its engines"),
    Exported("pool_engine_bytes", Gauge, "bytes of the pool this engine holds"),
    Exported("pool_pages_taken", Counter, "pool pages this engine took"),
    Exported("pool_pages_given", Counter, "pool pages this engine gave back"),
    Exported("handoffs", Counter, "KV handoffs between a prefill and a decode engine (either side counts each)"),
    Exported("handoff_bytes_copied", Counter, "bytes of KV the handoffs copied (vmm remaps pages: 0)"),
    Exported("handoff_units_moved", Counter, "pages or blocks the handoffs moved"),
    Exported("handoff_seconds", Counter, "cumulative seconds in handoffs", unit="seconds"),
    Exported("handoffs_failed", Counter, "handoffs that failed (peer gone, refused, mismatched)"),
    Exported("handoffs_expired", Counter, "prefill KV released because no decode engine pulled it in time"),
    Exported("handoff_latency", Histogram, "one request's KV handoff", unit="seconds"),
    Exported("requests_finished", Counter, "requests that finished"),
    Exported("num_failed", Counter, "requests that failed alone", old="requests_failed"),
    Exported("requests_aborted", Counter, "requests aborted (client gone or server stopping)"),
    Exported("output_tokens", Counter, "output tokens of finished requests", vllm="generation_tokens"),
    Exported("prompt_tokens", Counter, "prompt tokens of finished requests"),
    Exported("ttft", Histogram, "arrival to first token (engine clock)", vllm="time_to_first_token_seconds"),
    Exported("tpot", Histogram, "(e2e - ttft) / (output tokens - 1)", vllm="time_per_output_token_seconds"),
    Exported("e2e", Histogram, "arrival to finish (engine clock)", vllm="e2e_request_latency_seconds"),
)
OLD_STATS_KEYS = {"kv_units_used": "used_units", "kv_units_total": "total_units"}   # GET /kvlab/stats, one release


def _register(m: Exported, name: str, registry: CollectorRegistry) -> Any:
    if m.kind is Histogram:
        return Histogram(name, m.help, buckets=LATENCY_BUCKETS, registry=registry)
    return m.kind(name, m.help, registry=registry)


class ServerMetrics:
    def __init__(self, backend: str) -> None:
        self.registry = r = CollectorRegistry()
        self.exported = {m.name: [_register(m, name, r) for name in m.prom_names] for m in METRICS}
        Gauge("kvlab_backend_info", "the KV backend", ["backend"], registry=r).labels(backend).set(1)
        self.base = dict.fromkeys(COUNTED, 0)       # RunMetrics counts folded in at each reset
        self.sent: dict[str, float] = {}            # what each counter fed from a running total has counted
        self.last_read = 0.0
        self.latest: dict[str, float] = {}         # GET /kvlab/stats: the last step's gauges (replaced whole)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def stats(self) -> dict[str, float]:
        """The gauges after the last step, as JSON-ready numbers (cheaper to poll than /metrics)."""
        return dict(self.latest)

    def _set(self, name: str, value: float) -> None:
        for gauge in self.exported[name]:
            gauge.set(value)

    def _inc(self, name: str, amount: float = 1) -> None:
        for counter in self.exported[name]:
            counter.inc(amount)

    def _observe(self, name: str, value: float) -> None:
        for histogram in self.exported[name]:
            histogram.observe(value)

    def _count_to(self, name: str, total: float) -> None:
        """Advance a counter to a running total read from the engine."""
        if total > self.sent.get(name, 0):
            self._inc(name, total - self.sent.get(name, 0))
            self.sent[name] = total

    def on_step(self, engine: Any, running: int, waiting: int, swapped: int, force: bool = False,
                handoffs: dict[str, float] | None = None) -> None:
        """After a step; `handoffs`: the engine's handoff totals (Engine.handoff.stats), when it has a role."""
        self._on_cache(engine, {"running": running, "waiting": waiting, "swapped": swapped})
        if handoffs is not None:
            self.on_handoffs(handoffs)
        now = time.monotonic()
        if now - self.last_read < READ_EVERY_S and not force:
            return
        self.last_read = now
        self._read_counts(engine)

    def on_idle(self, engine: Any) -> None:
        """Between steps (an idle engine): refresh the memory gauges and the pool block, which change while
        nothing steps (a steward gives pages away; a prefill engine frees kept KV that was pulled or expired).
        The queue gauges keep the last step's values (zeros before the first step)."""
        queues = {name: self.latest.get(name, 0) for name in ("running", "waiting", "swapped")}
        self._on_cache(engine, queues)

    def _on_cache(self, engine: Any, queues: dict[str, float]) -> None:
        """The queue and memory gauges, the cache's counters and the pool block; GET /kvlab/stats' top level."""
        s = engine.cache_stats()
        gauges = queues | {"used_units": s.used_units, "total_units": s.total_units, "mapped_bytes": s.mapped_bytes,
                           "kv_usage_ratio": s.used_units / s.total_units if s.total_units else 0.0,
                           "kv_utilization": s.live_tokens / s.allocated_token_slots
                           if s.allocated_token_slots else 0.0}
        for name, value in gauges.items():
            self._set(name, value)
        for name in CACHE_COUNTED:
            self._count_to(name, getattr(s, name))
        self.latest = {k: v for k, v in self.latest.items() if k in ("handoff",)} | gauges \
            | {old: gauges[new] for old, new in OLD_STATS_KEYS.items()}
        if "pool" in s.extra:
            self._on_pool(s.extra["pool"])

    def _on_pool(self, pool: dict[str, Any]) -> None:
        """The pool block: gauges and counters under pool_*, and the block itself in GET /kvlab/stats."""
        for name in ("total_bytes", "used_bytes", "engine_bytes"):
            self._set("pool_" + name, pool[name])
        for name in ("pages_taken", "pages_given"):
            self._count_to("pool_" + name, pool[name])
        self.latest["pool"] = dict(pool)

    def on_handoffs(self, totals: dict[str, float]) -> None:
        """The engine's handoff totals (Engine.handoff.stats) -> the counters and GET /kvlab/stats' "handoff"."""
        for key, name in HANDOFF_COUNTED.items():
            self._count_to(name, totals[key])
        self.latest["handoff"] = {key: totals[key] for key in HANDOFF_COUNTED}

    def _read_counts(self, engine: Any) -> None:
        m = engine.metrics()                       # computes percentiles: read a few times a second, not per step
        for name in COUNTED:
            self._count_to(name, self.base[name] + getattr(m, name))
        if m.num_steps >= RESET_STEPS:
            for name in COUNTED:
                self.base[name] += getattr(m, name)
            engine.reset_metrics()

    def on_finished(self, out: Any, now: float) -> None:
        if out.error is not None:
            self._inc("num_failed")
            return
        self._inc("requests_finished")
        n_out = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
        self._inc("output_tokens", sum(len(c.token_ids) for c in out.outputs))
        self._inc("prompt_tokens", len(out.prompt_token_ids))
        if out.handoff is not None and out.handoff["units_moved"]:    # a prefill output's KV moves later: zeros
            self._observe("handoff_latency", out.handoff["seconds"])
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        end = m.finished_time if m.finished_time is not None else now
        self._observe("ttft", m.first_token_time - m.arrival_time)
        self._observe("e2e", end - m.arrival_time)
        if n_out > 1:
            self._observe("tpot", (end - m.first_token_time) / (n_out - 1))

    def on_abort(self) -> None:
        self._inc("requests_aborted")
