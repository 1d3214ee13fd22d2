"""`kvlab bench`'s report: the side-by-side table, the greedy-agreement note, and the results directory
(provenance.json, results.json, results.csv, requests.csv, throughput.png, batch.png, kv_memory.png)."""
from __future__ import annotations

import json
from typing import Any

from kvlab.experiments.bench.plan import BenchPlan, BenchSettings, workload_spec

PHASES = ("prefill", "decode")
SECONDS_AS_MS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99")


def side_by_side(runs: list[dict[str, Any]]) -> str:
    """Deterministic figures once; every timed figure as `median [min-max]` over the repeats; then, per
    backend against the first, whether their throughput runs overlap."""
    from kvlab.experiments.reporting.tables import fmt, pct, table, verdict, with_spread
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"
    timed = lambda key, f=fmt: lambda r: with_spread(r.get("repeats", {}).get(key) or [r[key]], f)
    rows = [
        ("output tok/s median [min-max]", timed("output_tokens_per_s")),
        ("  every run", lambda r: " ".join(f"{v:,.0f}" for v in r["repeats_output_tokens_per_s"])),
        ("mean batch (max)", lambda r: f"{r['mean_batch']:.1f} ({r['max_batch']})"),
        ("KV utilisation", lambda r: pct(r["kv_utilization"]) + (
            " (shared slots)" if r["kv_utilization"] > 1 else "")),
        ("preemptions", lambda r: fmt(r["preemptions"])),
        ("TTFT p50 ms", timed("ttft_p50", ms)),
        ("TPOT p50 ms", timed("tpot_p50", ms)),
        ("allocator share", timed("allocator_share", pct)),
        ("  bg mapper s (not in share)", lambda r: f"{(r.get('cache_extra') or {}).get('background_seconds', 0):.2f}"),
        ("  OS map+unmap calls (s)", os_calls),
        ("    admit / grow / mapper / rest", os_calls_by_cause),
        ("scheduler s", timed("scheduler_seconds", lambda v: f"{v:.2f}")),
        ("wall s", timed("wall_seconds", lambda v: f"{v:.1f}")),
        ("engine build s (KV memory)", timed("build_seconds", lambda v: f"{v:.2f}")),
        ("steps", lambda r: fmt(r["num_steps"])),
        ("peak units used", lambda r: f"{r['peak_used_units']:,}/{r['total_units']:,} {r['unit_name']}s"),
        ("kernels (prefill, decode)", kernels_of),
        ("kernel fallbacks", lambda r: str(len(r["kernel_fallbacks"]))),
        ("linear layers' GEMM", lambda r: r["linear"]),
        ("outputs = first backend", lambda r: f"{r['outputs_match_first']}/{r['num_requests']}"),
    ]
    if any(r.get("tp_comm") for r in runs):       # tensor parallelism: rank 0's communication per step
        rows.append(("TP bcast + allreduce us/step", lambda r: "-" if not r.get("tp_comm") else
                     f"{r['tp_comm']['broadcast_us']:,.0f} + {r['tp_comm']['allreduce_us']:,.0f} "
                     f"({pct(r['tp_comm']['comm_share'])} of {r['tp_comm']['step_us']:,.0f})"))
    body = [[label, *(f(r) for r in runs)] for label, f in rows]
    first = runs[0]
    verdicts = [verdict(r["backend"], r["repeats_output_tokens_per_s"], first["backend"],
                        first["repeats_output_tokens_per_s"], "output tok/s") + kernel_note(r, first) for r in runs[1:]]
    return "\n".join([table(["", *(r["backend"] for r in runs)], body), "", *verdicts])


def os_calls(run: dict[str, Any]) -> str:
    """The driver's map and unmap calls and their seconds, both threads (the floor under a page-mapping
    allocator's share: each page group moved is one call per tensor)."""
    cache = run.get("cache") or {}
    calls = cache.get("map_calls", 0) + cache.get("unmap_calls", 0)
    seconds = cache.get("map_seconds", 0.0) + cache.get("unmap_seconds", 0.0)
    return f"{calls:,} ({seconds:.2f})" if calls else "-"


def os_calls_by_cause(run: dict[str, Any]) -> str:
    """Those calls by what made them (vmm's counters): first allocations and growths on the step, the background
    mapper's jobs, and the rest (frees, swaps, forks)."""
    cache, extra = run.get("cache") or {}, run.get("cache_extra") or {}
    causes = [extra.get(k) for k in ("admission_calls", "growth_calls", "mapper_calls")]
    if None in causes:
        return "-"
    rest = cache.get("map_calls", 0) + cache.get("unmap_calls", 0) - sum(causes)
    return " / ".join(f"{n:,}" for n in (*causes, rest))


def kernels_of(run: dict[str, Any]) -> str:
    return ", ".join(run["kernels"].get(p, "-") for p in PHASES)


def kernel_note(run: dict[str, Any], other: dict[str, Any]) -> str:
    """Two backends that ran different attention kernels: the gap is the kernels' as much as the memory managers'."""
    if all(run["kernels"].get(p) == other["kernels"].get(p) for p in PHASES):
        return ""
    return (f"; they ran different attention kernels ({run['backend']}: {kernels_of(run)}; {other['backend']}: "
            f"{kernels_of(other)}), so the difference is not the memory manager's alone")


def agreement_note(plan: BenchPlan, runs: list[dict[str, Any]]) -> str:
    """Below fp32 the backends' kernels reduce in different orders, so greedy tokens may differ (not a bug,
    docs/reliability.md "Mixed precision"): say how often they agree instead of implying they must."""
    dtype = plan.configs[plan.backends[0]].dtype
    if dtype == "float32" or len(runs) < 2:
        return ""
    rates = ", ".join(f"{r['backend']} {r['outputs_match_first']}/{r['num_requests']} "
                      f"({100 * r['outputs_match_first'] / max(1, r['num_requests']):.0f}%)" for r in runs[1:])
    return (f"{dtype}: greedy outputs equal to {runs[0]['backend']}'s: {rates}; below float32 the kernels' "
            "reduction order may change a token (expected, see docs/reliability.md)")


def write_results(plan: BenchPlan, runs: list[dict[str, Any]], settings: BenchSettings) -> None:
    from kvlab.experiments.reporting.provenance import jsonable, provenance, write_provenance
    from kvlab.experiments.reporting.tables import write_csv
    out = plan.out_dir
    record = provenance(run_config(plan, settings))
    write_provenance(out, record)
    workload = {"backends": plan.backends, "workload": [r.to_json() for r in plan.requests],
                "warmup_requests": plan.warmup}
    slim = [{k: v for k, v in r.items() if k not in ("output_ids", "requests")} for r in runs]
    (out / "results.json").write_text(json.dumps(jsonable({"provenance": record, "settings": workload, "runs": slim}),
                                                 indent=1))
    write_csv(out / "results.csv", [csv_row(r) for r in runs])
    write_csv(out / "requests.csv", [{"backend": r["backend"], **q} for r in runs for q in r["requests"]])
    write_plots(plan, runs)


def run_config(plan: BenchPlan, settings: BenchSettings) -> dict[str, Any]:
    """The resolved configuration: each backend's engine config as run, its cache as built, the workload's
    spec and the repeats."""
    from kvlab.experiments.reporting.provenance import engine_config
    return {"command": "bench", "backends": plan.backends, "workload": workload_spec(settings),
            "repeats": settings.repeats, "warmup_requests": plan.warmup,
            "engine": {b: engine_config(c) for b, c in plan.configs.items()}, "built": plan.built}


def csv_row(run: dict[str, Any]) -> dict[str, Any]:
    """One backend's flat row, every column named with its unit (ms, s, tokens, fraction); nested figures as
    columns of their own (kernel per phase, fallback count, throughput range over the repeats)."""
    row: dict[str, Any] = {}
    for key, value in run.items():
        if key in SECONDS_AS_MS:
            row[f"{key}_ms"] = None if value is None else 1000 * value
        elif not isinstance(value, (dict, list)) and key != "tp_comm":
            row[key] = value
    row.update({f"kernel_{p}": run["kernels"].get(p, "") for p in PHASES})
    row["kernel_fallbacks"] = len(run["kernel_fallbacks"])
    repeats = run["repeats_output_tokens_per_s"]
    row.update(output_tokens_per_s_min=min(repeats), output_tokens_per_s_max=max(repeats), repeats=len(repeats))
    return row


def write_plots(plan: BenchPlan, runs: list[dict[str, Any]]) -> None:
    from kvlab.experiments.reporting.plots import Series, bar_chart, line_chart
    out = plan.out_dir
    names = [r["backend"] for r in runs]
    spread = [(min(r["repeats_output_tokens_per_s"]), max(r["repeats_output_tokens_per_s"])) for r in runs]
    bar_chart(out / "throughput.png", names, [r["output_tokens_per_s"] for r in runs], "output tokens / s",
              f"Throughput: median of {len(runs[0]['repeats_output_tokens_per_s'])} runs, bars min-max", spread)
    by_step = plan.x_axis == "step"      # step index: identical schedules draw identical lines
    xs = lambda r: list(range(len(r["timeline"]["time"]))) if by_step else r["timeline"]["time"]
    xlabel = "engine step" if by_step else "seconds"
    line_chart(out / "batch.png", [Series(r["backend"], xs(r), r["timeline"]["running"]) for r in runs],
               xlabel, "running sequences", "Running batch")
    mib = lambda r, key: [v * r["bytes_per_token"] / 2**20 for v in r["timeline"][key]]
    memory = []
    for i, r in enumerate(runs):
        memory.append(Series(f"{r['backend']} allocated", xs(r), mib(r, "allocated_token_slots"), color=f"C{i}",
                             linestyle="-"))
        memory.append(Series(f"{r['backend']} live", xs(r), mib(r, "live_tokens"), color=f"C{i}", linestyle=":"))
    line_chart(out / "kv_memory.png", memory, xlabel, "KV MiB", "KV memory held by sequences (dotted: live)")
