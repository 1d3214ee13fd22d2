"""`kvlab bench`: one workload through several backends in one process, one after another, side by side.

Same model object, same requests, same seeds and thread count for every backend; each backend gets a short
warm-up first. Greedy decoding with ignore_eos, so every backend produces the same number of tokens (and,
kernels permitting, the same tokens: the report counts requests whose outputs match the first backend's).
Results go to results/<timestamp>/ (or --out): results.json, results.csv and PNG plots. The flags are read
here, once, into a BenchSettings; plan.py, runs.py and report.py take plain values.
"""
from __future__ import annotations

import argparse
import importlib
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import backend_names
from kvlab.common.limits import check_seed
from kvlab.common.machine import max_threads
from kvlab.common.validate import check_int
from kvlab.experiments.bench.plan import BenchSettings, check_model_lens, check_settings, describe, load, make_plan
from kvlab.experiments.bench.report import agreement_note, side_by_side, write_results
from kvlab.experiments.bench.runs import mark_matching_outputs, run_rounds
from kvlab.experiments.cli import flags
from kvlab.experiments.reporting.verdict import short_run_warning
from kvlab.experiments.workloads.requests import parse_workload

DEFAULT_BACKENDS = ["vmm", "paged", "reserve"]
DEFAULT_REQUESTS = 256
STEADY_REQUESTS = DEFAULT_REQUESTS   # fewer: the start and the drain weigh on tok/s (reporting/verdict.py)
WARMUP_REQUESTS = 4
DEFAULT_REPEATS = 3              # CPU timings are noisy (docs/experiments.md): interleave rounds, report medians


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="A/B: one workload through several backends, side by side",
                              description="Run one workload through several backends in one process.")
    p.add_argument("--backends", type=flags.parse_list, default=DEFAULT_BACKENDS,
                   help=f"comma list of {', '.join(backend_names())} (default: {','.join(DEFAULT_BACKENDS)})")
    p.add_argument("--num-requests", type=int, default=DEFAULT_REQUESTS)
    p.add_argument("--workload", type=flags.arg_type(parse_workload), default=parse_workload("seed"),
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
    flags.add_engine_flags(p, skip=("backend",))
    p.set_defaults(run=run)
    from kvlab.experiments.bench import handoff  # `kvlab bench handoff`: the prefill->decode KV handoff table
    from kvlab.experiments.loadgen import cli as bench_cli  # `kvlab bench serve ...`: the HTTP load generator
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE")
    bench_cli.add_parser(modes)
    handoff.add_parser(modes)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The one place `kvlab bench`'s flags are read."""
    engine_flags = {k: getattr(args, k, None) for k in ("config", *flags.engine_flag_names())}
    return BenchSettings(tuple(args.backends), args.workload, args.num_requests, args.scale, args.max_len,
                         args.rate, args.warmup, args.repeats, args.out, args.plot_x, not args.no_progress,
                         engine_flags)


def run(args: argparse.Namespace) -> int:
    if args.suite == "perf":
        return run_perf_suite(args.out, args.threads, args.seed)
    return run_bench(settings_from(args))


def run_bench(settings: BenchSettings) -> int:
    import torch
    check_settings(settings)
    probe = settings.engine_config(settings.backends[0])
    if probe.threads:
        torch.set_num_threads(probe.threads)
    model, tokenizer = load(probe)
    plan = make_plan(settings, model)
    check_model_lens(plan.configs, model)
    check_capacity(plan, model, tokenizer)
    print(describe(plan, model))
    runs = run_rounds(plan, model, tokenizer, settings.repeats, progress=settings.progress)
    mark_matching_outputs(runs)
    print()
    print(side_by_side(runs))
    note = agreement_note(plan, runs)
    if note:
        print(note)
    warning = short_run_warning(settings.num_requests, STEADY_REQUESTS, "tok/s and req/s")
    if warning:
        print(warning)
    write_results(plan, runs, settings)
    print(f"\nresults in {plan.out_dir}/ (provenance.json, results.json, results.csv, requests.csv, throughput.png, "
          "batch.png, kv_memory.png)")
    return 0


def check_capacity(plan: Any, model: Any, tokenizer: Any) -> None:
    """Refuse a budget in which every request of the workload would fail (each fails alone, so the run would
    end with exit 0 and a table of zeros): each backend's cache must hold the shortest request."""
    from kvlab.common.engine import Engine
    shortest = min(len(p) + r.output_len for p, r in zip(plan.prompts, plan.requests))
    for name, config in plan.configs.items():
        engine = Engine.from_model(config, model, tokenizer)
        try:
            limit = engine.cache.allocator.max_tokens_per_seq()
        finally:
            engine.close()
        if shortest > limit:
            raise ConfigError(f"--kv-cache-bytes {config.kv_cache_bytes:,}: the {name} cache holds at most {limit:,} "
                              f"tokens per sequence, less than the shortest request ({shortest:,}): every request "
                              "would fail; raise --kv-cache-bytes")


def run_perf_suite(out: str | None, threads: int | None, seed: int | None) -> int:
    try:
        entry = importlib.import_module("kvlab.experiments.bench.perf.__main__")
    except ModuleNotFoundError as e:
        if e.name not in ("kvlab.experiments.bench.perf", "kvlab.experiments.bench.perf.__main__"):
            raise
        raise ConfigError("--suite perf needs the benchmarks package (python -m kvlab.experiments.bench.perf), which "
                          "is not installed in this checkout") from None
    if not hasattr(entry, "main"):
        raise ConfigError("experiments/bench/perf/__main__.py has no main(argv); cannot run --suite perf")
    if threads is not None:
        check_int("--threads", threads, 1, max_threads(), " (at most 4 per CPU)")
    if seed is not None:
        check_seed("--seed", seed)
    flags.check_output_path(out, "--out", directory=True)
    argv = ["--out", out] if out else []
    for flag, value in (("--threads", threads), ("--seed", seed)):
        if value is not None:
            argv += [flag, str(value)]
    return int(entry.main(argv) or 0)
