"""`kvlab bench`'s runs: every backend in turn for a number of rounds, one engine per run, each request
submitted at its arrival time; per backend the median-throughput run is kept."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from kvlab.experiments.bench.plan import BenchPlan

log = logging.getLogger("kvlab.bench")

RUN_KEYS = ("backend", "output_tokens_per_s", "total_tokens_per_s", "mean_batch", "max_batch", "kv_utilization",
            "preemptions", "recomputed_tokens", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90",
            "tpot_p99", "allocator_seconds", "allocator_share", "scheduler_seconds", "wall_seconds", "num_steps",
            "output_tokens", "prompt_tokens", "num_failed", "peak_used_units", "total_units", "unit_name",
            "tokens_per_unit", "peak_mapped_bytes", "mean_internal_waste_tokens", "mean_reserved_waste_tokens",
            "kernels", "kernel_fallbacks")



def run_rounds(plan: BenchPlan, model: Any, tokenizer: Any, repeats: int, progress: bool) -> list[dict[str, Any]]:
    """`repeats` rounds of every backend in turn (a machine-wide slowdown hits all backends alike); per backend
    the run with the median output throughput is reported, with every run's throughput beside it."""
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in plan.backends}
    for round_ in range(repeats):
        for name in plan.backends:
            label = name if repeats == 1 else f"{name} {round_ + 1}/{repeats}"
            runs[name].append(bench_backend(name, plan, model, tokenizer, label, progress, warn=round_ == 0))
    return [median_run(runs[b]) for b in plan.backends]


TIMED_KEYS = ("output_tokens_per_s", "total_tokens_per_s", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90",
              "allocator_seconds", "allocator_share", "scheduler_seconds", "wall_seconds", "build_seconds")


def median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median-throughput run, with every timed figure of every repeat beside it (`repeats`) so each can
    be reported with its spread."""
    ordered = sorted(rows, key=lambda r: r["output_tokens_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["repeats_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in rows]
    chosen["repeats"] = {k: [r.get(k) for r in rows] for k in TIMED_KEYS}
    chosen["outputs_stable_across_repeats"] = all(r["output_ids"] == rows[0]["output_ids"] for r in rows)
    return chosen


def bench_backend(name: str, plan: BenchPlan, model: Any, tokenizer: Any, label: str = "",
                  progress: bool = True, warn: bool = True) -> dict[str, Any]:
    from kvlab.common.capacity import warn_capacity
    from kvlab.common.engine import Engine
    config = plan.configs[name]
    started = time.perf_counter()
    engine = Engine.from_model(config, model, tokenizer)
    build_seconds = time.perf_counter() - started   # the KV store's memory is allocated here (not in the steps)
    if warn:
        warn_capacity(config, engine.cache)
    try:
        warm_up(engine, plan)
        engine.reset_metrics()
        comm_stats = getattr(engine.runner, "comm_stats", None)      # tensor parallelism (common/dist/)
        if comm_stats is not None:
            engine.runner.reset_comm_stats()
        t0 = engine.runner.clock()
        outputs, requests = drive(engine, plan, t0, bar_for(label or name, len(plan.requests), progress))
        m = engine.metrics()
        stats = engine.cache_stats()
        comm = comm_stats() if comm_stats is not None else None
    finally:
        engine.close()
    row = {k: getattr(m, k) for k in RUN_KEYS}
    row["build_seconds"] = build_seconds
    row["linear"] = engine.runner.model.linear.name      # the Linear layers' GEMM (common/linear.py)
    row["cache"] = {k: v for k, v in stats.to_dict().items() if k != "extra"}
    row["cache_extra"] = stats.extra
    row["tp_comm"] = comm
    row["bytes_per_token"] = engine.cache.shape.bytes_per_token
    row["timeline"] = {**m.timeline, "time": [t - t0 for t in m.timeline["time"]]}
    row["output_ids"] = [outputs[i] for i in range(len(plan.requests))]
    row["requests"] = [requests[i] for i in range(len(plan.requests))]
    return row


def warm_up(engine: Any, plan: BenchPlan) -> None:
    from kvlab.common.sampling_params import SamplingParams
    for prompt in plan.prompts[:plan.warmup]:
        engine.add_request(prompt[:32], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def drive(engine: Any, plan: BenchPlan, t0: float, bar: Any) -> tuple[dict[int, list[int]], dict[int, dict]]:
    """Submit each request at t0 + arrival_s (wall clock); returns output token ids and each request's record
    (request_record), by request index."""
    from kvlab.common.sampling_params import SamplingParams
    pending = deque(sorted(range(len(plan.requests)), key=lambda i: plan.requests[i].arrival_s))
    index: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    records: dict[int, dict[str, Any]] = {}
    while pending or engine.has_unfinished():
        now = engine.runner.clock()
        while pending and t0 + plan.requests[pending[0]].arrival_s <= now:
            i = pending.popleft()
            r = plan.requests[i]
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            index[engine.add_request(plan.prompts[i], params, arrival_time=t0 + r.arrival_s)] = i
        if not engine.has_unfinished():
            time.sleep(max(0.0, t0 + plan.requests[pending[0]].arrival_s - engine.runner.clock()))
            continue
        for out in engine.step().finished:
            if out.error:
                log.warning("request %s failed: %s", out.request_id, out.error)
            i = index[out.request_id]
            outputs[i] = out.outputs[0].token_ids if out.outputs else []
            records[i] = request_record(i, plan.requests[i], out, len(outputs[i]))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return outputs, records


def request_record(index: int, request: Any, out: Any, output_tokens: int) -> dict[str, Any]:
    """One line of requests.csv: the request's lengths and latencies in ms (None where it produced no token)."""
    m = out.metrics
    ms = lambda seconds: None if seconds is None else round(1000 * seconds, 3)
    ttft = m.ttft if m else None
    e2e = m.finished_time - m.arrival_time if m and m.finished_time is not None else None
    tpot = (e2e - ttft) / (output_tokens - 1) if ttft is not None and e2e is not None and output_tokens > 1 else None
    return {"request": index, "arrival_ms": ms(request.arrival_s), "prompt_tokens": request.prompt_len,
            "output_tokens": output_tokens, "ttft_ms": ms(ttft), "tpot_ms": ms(tpot), "e2e_ms": ms(e2e),
            "preemptions": m.num_preemptions if m else 0, "recomputed_tokens": m.recomputed_tokens if m else 0,
            "error": out.error or ""}


def bar_for(name: str, total: int, enabled: bool):
    if not enabled:
        return None
    from kvlab.experiments.reporting.tables import progress_bar
    return progress_bar(total=total, desc=f"{name:>12}", unit="req", leave=True)


def mark_matching_outputs(runs: list[dict[str, Any]]) -> None:
    """Greedy decoding of one model: each backend should reproduce the first backend's tokens."""
    ref = runs[0]["output_ids"]
    for r in runs:
        r["outputs_match_first"] = sum(a == b for a, b in zip(ref, r["output_ids"]))
        r["num_requests"] = len(ref)
