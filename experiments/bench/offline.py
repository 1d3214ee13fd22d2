"""`kvlab bench`: one workload through several backends in one process, one after another, side by side.

Same model object, same requests, same seeds and thread count for every backend; each backend gets a short
warm-up first. Greedy decoding with ignore_eos, so every backend produces the same number of tokens (and,
kernels permitting, the same tokens: the report counts requests whose outputs match the first backend's).
Results go to results/<timestamp>/ (or --out): results.json, results.csv and PNG plots.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.common.config import EngineConfig
from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_REQUESTS, check_int_range
from kvlab.experiments.cli import main as cli
from kvlab.experiments.reporting.tables import results_dir, threads_label, workload_changes
from kvlab.experiments.workloads import requests as workload
from kvlab.experiments.workloads.requests import Request, build_workload, parse_workload, prompt_token_ids, scaled

log = logging.getLogger("kvlab.bench")

DEFAULT_BACKENDS = ["vmm", "paged", "reserve"]
DEFAULT_SCALE = 1 / 8            # seed lengths / 8: prompts median 73, outputs mean 47, max length 512
DEFAULT_REQUESTS = 256
RESERVE_SEQS = 8                 # default KV budget: this many max-length reservations
DEFAULT_MAX_NUM_SEQS = 256       # high enough that KV memory, not the slot count, limits the batch
WARMUP_REQUESTS = 4
DEFAULT_REPEATS = 3              # CPU timings are noisy (cpu-facts.md §10): interleave rounds, report medians
RUN_KEYS = ("backend", "output_tokens_per_s", "total_tokens_per_s", "mean_batch", "max_batch", "kv_utilization",
            "preemptions", "recomputed_tokens", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90",
            "tpot_p99", "allocator_seconds", "allocator_share", "scheduler_seconds", "wall_seconds", "num_steps",
            "output_tokens", "prompt_tokens", "num_failed", "peak_used_units", "total_units", "unit_name",
            "tokens_per_unit", "peak_mapped_bytes", "mean_internal_waste_tokens", "mean_reserved_waste_tokens",
            "kernels", "kernel_fallbacks")


@dataclass(slots=True)
class BenchPlan:
    backends: list[str]
    configs: dict[str, EngineConfig]
    requests: list[Request]
    prompts: list[list[int]]
    warmup: int
    out_dir: Path
    changes: list[str]               # every transformation applied to the workload, printed in the header
    x_axis: str = "step"             # plots: engine step or wall seconds


# -- CLI ------------------------------------------------------------------------------------------------------

def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="A/B: one workload through several backends, side by side",
                              description="Run one workload through several backends in one process.")
    p.add_argument("--backends", type=cli.parse_list, default=DEFAULT_BACKENDS, help="comma list (vmm,paged,reserve)")
    p.add_argument("--num-requests", type=int, default=DEFAULT_REQUESTS)
    p.add_argument("--workload", type=cli.arg_type(parse_workload), default=parse_workload("seed"),
                   help="seed | fixed:P:O | uniform:PLO-PHI:OLO-OHI | trace:FILE.jsonl")
    p.add_argument("--scale", type=float, default=None,
                   help="multiply every length (default: 1/8 for the seed workload, 1 for any other)")
    p.add_argument("--max-len", type=int, default=4096, help="max prompt + output before --scale (synthetic kinds)")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--warmup", type=int, default=WARMUP_REQUESTS, help="warm-up requests per backend run")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="rounds over all backends (interleaved); each backend reports its median-throughput run")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>)")
    p.add_argument("--suite", choices=["perf"],
                   help="run the performance suite (python -m kvlab.experiments.bench.perf) instead")
    p.add_argument("--plot-x", choices=["step", "time"], default="step",
                   help="x axis of batch.png and kv_memory.png: engine step (default) or wall seconds")
    p.add_argument("--no-progress", action="store_true")
    cli.add_engine_flags(p, skip=("backend",))
    p.set_defaults(run=run)
    from kvlab.experiments.loadgen import cli as bench_cli  # `kvlab bench serve ...`: the HTTP load generator
    bench_cli.add_parser(p.add_subparsers(dest="bench_mode", metavar="MODE"))


def run(args: argparse.Namespace) -> int:
    if args.suite == "perf":
        return run_perf_suite(args)
    import torch
    check_args(args)
    probe = cli.engine_config(args, backend=args.backends[0])
    if probe.threads:
        torch.set_num_threads(probe.threads)
    model, tokenizer = load(probe)
    plan = make_plan(args, model)
    check_model_lens(plan.configs, model)
    print(describe(plan, model))
    runs = run_rounds(plan, model, tokenizer, args.repeats, progress=not args.no_progress)
    mark_matching_outputs(runs)
    print()
    print(side_by_side(runs))
    note = agreement_note(plan, runs)
    if note:
        print(note)
    write_results(plan, runs)
    print(f"\nresults in {plan.out_dir}/ (results.json, results.csv, throughput.png, batch.png, kv_memory.png)")
    return 0


def run_perf_suite(args: argparse.Namespace) -> int:
    import importlib
    try:
        entry = importlib.import_module("kvlab.experiments.bench.perf.__main__")
    except ModuleNotFoundError as e:
        if e.name not in ("kvlab.experiments.bench.perf", "kvlab.experiments.bench.perf.__main__"):
            raise
        raise ConfigError("--suite perf needs the benchmarks package (python -m kvlab.experiments.bench.perf), which "
                          "is not installed in this checkout") from None
    if not hasattr(entry, "main"):
        raise ConfigError("experiments/bench/perf/__main__.py has no main(argv); cannot run --suite perf")
    argv = ["--out", args.out] if args.out else []
    for flag, value in (("--threads", args.threads), ("--seed", args.seed)):
        if value is not None:
            argv += [flag, str(value)]
    return int(entry.main(argv) or 0)


# -- plan -----------------------------------------------------------------------------------------------------

def check_args(args: argparse.Namespace) -> None:
    from kvlab.common.kv.registry import backend_names
    BACKENDS = backend_names()
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"unknown backend(s) {', '.join(unknown)}; choose from: {', '.join(BACKENDS)}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    check_int_range("--warmup", args.warmup, 0, MAX_REQUESTS)
    check_int_range("--repeats", args.repeats, 1, 1000)
    workload.build_workload(workload_spec(args))     # every length and arrival checked before the model loads
    cli.check_output_path(args.out, "--out", directory=True)


def workload_spec(args: argparse.Namespace) -> workload.WorkloadSpec:
    return dataclasses.replace(args.workload, num_requests=args.num_requests, scale=default_scale(args),
                               max_len=args.max_len, rate=args.rate, seed=args.seed if args.seed is not None else 0)


def check_model_lens(configs: dict[str, EngineConfig], model: Any) -> None:
    """Every backend's max_model_len within the model's positions, before any cache is built."""
    from kvlab.common.runner import check_model_len
    for config in configs.values():
        check_model_len(config.max_model_len, model.config.max_position_embeddings)


def make_plan(args: argparse.Namespace, model: Any) -> BenchPlan:
    spec = workload_spec(args)
    requests = build_workload(spec)
    longest = max(r.total_len for r in requests)
    probe = cli.engine_config(args, backend=args.backends[0])
    shape = model.kv_shape(probe.dtype, probe.device)
    defaults = bench_defaults(args, probe, shape, max(longest, scaled(spec.max_len, spec.scale)))
    configs = {b: cli.engine_config(args, backend=b, **defaults, **backend_defaults(args, b))
               for b in args.backends}
    check_budgets(configs, shape)
    prompts = prompt_token_ids(requests, model.config.vocab_size, seed=spec.seed)
    out = results_dir(args.out)
    changes = workload_changes(spec, scale_given=args.scale is not None, default_scale=DEFAULT_SCALE)
    return BenchPlan(list(args.backends), configs, requests, prompts, args.warmup, out, changes,
                     getattr(args, "plot_x", "step"))


def default_scale(args: argparse.Namespace) -> float:
    """--scale when given; else 1/8 for the built-in seed distribution (CPU-sized) and 1 for anything the user
    supplied (a trace, fixed or uniform lengths): user data is never transformed unless asked."""
    if args.scale is not None:
        return args.scale
    return DEFAULT_SCALE if args.workload.kind == "seed" else 1.0


def check_budgets(configs: dict[str, EngineConfig], shape: Any) -> None:
    """Build every backend's cache in accounting mode (its geometry and budget checks, no memory) so a bad
    budget fails before the header is printed, not after it."""
    from kvlab.common.kv.seam import create_cache
    for config in configs.values():
        create_cache(config, shape, accounting_only=True).close()


def backend_defaults(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """A backend to which the growth watermark does not apply (the reserve baseline holds its final length
    from admission) runs without one unless --watermark says otherwise (as in the simulator), instead of
    losing a sequence."""
    from kvlab.common.config import load_toml
    from kvlab.common.kv.registry import get_backend
    given = args.watermark is not None or (args.config and "watermark" in load_toml(args.config))
    return {"watermark": 0.0} if not get_backend(backend).watermark and not given else {}


def bench_defaults(args: argparse.Namespace, probe: EngineConfig, shape: Any, max_len: int) -> dict[str, Any]:
    """Values the bench picks when neither a flag nor the --config file sets them."""
    from kvlab.common.config import load_toml
    given = set(load_toml(args.config)) if args.config else set()
    given |= {k for k in cli.engine_flag_names() if getattr(args, k, None) is not None}
    choices: dict[str, Any] = {
        "max_model_len": max_len,
        "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
        "max_num_batched_tokens": max(2048, max_len, DEFAULT_MAX_NUM_SEQS),
        "kv_cache_bytes": RESERVE_SEQS * max_len * shape.bytes_per_token,
        "threads": 1,                # the config default too; named here so a TOML value still wins
    }
    if "page_size" not in given:     # same grain as the paged blocks: compare mechanisms, not granularity
        grain = probe.options_of("paged").block_size * shape.bytes_per_token_per_layer
        choices["page_size"] = -(-grain // 4096) * 4096
    return {k: v for k, v in choices.items() if k not in given}


def load(config: EngineConfig):
    from kvlab.common.loader import load_model
    t0 = time.perf_counter()
    model, tokenizer = load_model(config.model, config.dtype, config.device, config.seed)
    log.info("loaded %s in %.1f s", config.model, time.perf_counter() - t0)
    return model, tokenizer


def describe(plan: BenchPlan, model: Any) -> str:
    c = plan.configs[plan.backends[0]]
    p = [r.prompt_len for r in plan.requests]
    o = [r.output_len for r in plan.requests]
    shape = model.kv_shape(c.dtype, c.device)
    reserve_seqs = c.kv_cache_bytes // shape.bytes_per_token // c.max_model_len
    watermarks = ", ".join(f"{b} {plan.configs[b].watermark:g}" for b in plan.backends)
    lines = [
        (f"kvlab bench: model {c.model} ({c.dtype}, {c.device}, {threads_label(c.threads)}), backends "
         f"{', '.join(plan.backends)}"),
        (f"workload: {len(plan.requests)} requests, prompts {min(p)}-{max(p)} (mean {sum(p) / len(p):.0f}), "
         f"outputs {min(o)}-{max(o)} (mean {sum(o) / len(o):.0f}), greedy, ignore_eos"),
        f"workload changes: {'; '.join(plan.changes) or 'none'}",
        (f"KV budget {c.kv_cache_bytes / 2**20:.1f} MiB = {c.kv_cache_bytes // shape.bytes_per_token:,} tokens "
         f"({shape.bytes_per_token:,} B/token); reserve holds {reserve_seqs} x {c.max_model_len} tokens; "
         f"block {c.options_of('paged').block_size} tokens, page {c.options_of('vmm').page_size // 1024} KiB "
         f"({c.options_of('vmm').page_size // shape.bytes_per_token_per_layer} tokens); watermark {watermarks}; "
         f"preemption {c.preemption_mode}"),
    ]
    return "\n".join(lines)


# -- runs -----------------------------------------------------------------------------------------------------

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
              "allocator_seconds", "allocator_share", "scheduler_seconds", "wall_seconds")


def median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median-throughput run, with every timed figure of every repeat beside it (`repeats`) so each can
    be reported with its spread."""
    ordered = sorted(rows, key=lambda r: r["output_tokens_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["repeats_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in rows]
    chosen["repeats"] = {k: [r.get(k) for r in rows] for k in TIMED_KEYS}
    chosen["outputs_stable_across_repeats"] = all(r["output_ids"] == rows[0]["output_ids"] for r in rows)
    return chosen


# -- one backend ----------------------------------------------------------------------------------------------

def bench_backend(name: str, plan: BenchPlan, model: Any, tokenizer: Any, label: str = "",
                  progress: bool = True, warn: bool = True) -> dict[str, Any]:
    from kvlab.common.capacity import warn_capacity
    from kvlab.common.engine import Engine
    config = plan.configs[name]
    engine = Engine.from_model(config, model, tokenizer)
    if warn:
        warn_capacity(config, engine.cache)
    try:
        warm_up(engine, plan)
        engine.reset_metrics()
        comm_stats = getattr(engine.runner, "comm_stats", None)      # tensor parallelism (common/dist/)
        if comm_stats is not None:
            engine.runner.reset_comm_stats()
        t0 = engine.runner.clock()
        outputs = drive(engine, plan, t0, bar_for(label or name, len(plan.requests), progress))
        m = engine.metrics()
        stats = engine.cache_stats()
        comm = comm_stats() if comm_stats is not None else None
    finally:
        engine.close()
    row = {k: getattr(m, k) for k in RUN_KEYS}
    row["cache"] = {k: v for k, v in stats.to_dict().items() if k != "extra"}
    row["cache_extra"] = stats.extra
    row["tp_comm"] = comm
    row["bytes_per_token"] = engine.cache.shape.bytes_per_token
    row["timeline"] = {**m.timeline, "time": [t - t0 for t in m.timeline["time"]]}
    row["output_ids"] = [outputs[i] for i in range(len(plan.requests))]
    return row


def warm_up(engine: Any, plan: BenchPlan) -> None:
    from kvlab.common.sampling_params import SamplingParams
    for prompt in plan.prompts[:plan.warmup]:
        engine.add_request(prompt[:32], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def drive(engine: Any, plan: BenchPlan, t0: float, bar: Any) -> dict[int, list[int]]:
    """Submit each request at t0 + arrival_s (wall clock); returns output token ids by request index."""
    from kvlab.common.sampling_params import SamplingParams
    pending = deque(sorted(range(len(plan.requests)), key=lambda i: plan.requests[i].arrival_s))
    index: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
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
            outputs[index[out.request_id]] = out.outputs[0].token_ids if out.outputs else []
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return outputs


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


# -- report ---------------------------------------------------------------------------------------------------

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
        ("KV utilisation", lambda r: pct(r["kv_utilization"])),
        ("preemptions", lambda r: fmt(r["preemptions"])),
        ("TTFT p50 ms", timed("ttft_p50", ms)),
        ("TPOT p50 ms", timed("tpot_p50", ms)),
        ("allocator share", timed("allocator_share", pct)),
        ("scheduler s", timed("scheduler_seconds", lambda v: f"{v:.2f}")),
        ("wall s", timed("wall_seconds", lambda v: f"{v:.1f}")),
        ("steps", lambda r: fmt(r["num_steps"])),
        ("peak units used", lambda r: f"{r['peak_used_units']:,}/{r['total_units']:,} {r['unit_name']}s"),
        ("kernels (prefill, decode)", lambda r: ", ".join(r["kernels"].get(p, "-") for p in ("prefill", "decode"))),
        ("kernel fallbacks", lambda r: str(len(r["kernel_fallbacks"]))),
        ("outputs = first backend", lambda r: f"{r['outputs_match_first']}/{r['num_requests']}"),
    ]
    if any(r.get("tp_comm") for r in runs):       # tensor parallelism: rank 0's communication per step
        rows.append(("TP bcast + allreduce us/step", lambda r: "-" if not r.get("tp_comm") else
                     f"{r['tp_comm']['broadcast_us']:,.0f} + {r['tp_comm']['allreduce_us']:,.0f} "
                     f"({pct(r['tp_comm']['comm_share'])} of {r['tp_comm']['step_us']:,.0f})"))
    body = [[label, *(f(r) for r in runs)] for label, f in rows]
    first = runs[0]
    verdicts = [verdict(r["backend"], r["repeats_output_tokens_per_s"], first["backend"],
                        first["repeats_output_tokens_per_s"]) for r in runs[1:]]
    return "\n".join([table(["", *(r["backend"] for r in runs)], body), "", *verdicts])


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


def write_results(plan: BenchPlan, runs: list[dict[str, Any]]) -> None:
    from kvlab.experiments.reporting.plots import Series, bar_chart, line_chart
    from kvlab.experiments.reporting.tables import write_csv
    out = plan.out_dir
    out.mkdir(parents=True, exist_ok=True)
    settings = {"backends": plan.backends, "configs": {b: c.to_dict() for b, c in plan.configs.items()},
                "workload": [r.to_json() for r in plan.requests], "warmup_requests": plan.warmup}
    slim = [{k: v for k, v in r.items() if k != "output_ids"} for r in runs]
    (out / "results.json").write_text(json.dumps({"settings": settings, "runs": slim}, indent=1, default=str))
    write_csv(out / "results.csv", [{k: v for k, v in r.items() if k not in ("timeline", "cache_extra", "cache")}
                                    for r in slim])
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
