"""`kvlab bench serve`: drive an OpenAI-compatible server (--base-url, or --host/--port), or, with --backends, start
one kvlab server per backend and sweep --request-rates over identical arrivals and prompts, --repeats interleaved
rounds per rate with a verdict per rate (see sweep.py), or, with --base-urls, drive several servers at once with
phase-shifted bursts (multi_cli.py).

The flags `vllm bench serve` also has carry its names, defaults and meanings, so a `vllm bench serve` command
line that uses only those runs unchanged; kvlab's older names stay as aliases."""
from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_output_path
from kvlab.experiments.cli import flags
from kvlab.experiments.loadgen import checks, latency, multi_cli, result_file
from kvlab.experiments.loadgen.client import BACKENDS, Target, Timeouts, fetch_model
from kvlab.experiments.loadgen.load_run import LoadSpec, bench_once, format_result, load_plan

DATASETS_WITH_FILE = ("sharegpt", "trace", "mooncake")
# (dataset, prompts) when not given: vLLM's for a run against a server, kvlab's for the sweep on the tiny model
DEFAULTS = {"run": ("random", 1000), "sweep": ("seed", 100)}
SWEEP_REPEATS = 3        # reporting/verdict.py's MIN_REPEATS: fewer runs per cell are not judged


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="load generator for an OpenAI-compatible server; --backends sweeps",
                              description=__doc__)
    add_target_flags(p)
    add_dataset_flags(p)
    add_traffic_flags(p)
    add_result_flags(p)
    add_sweep_flags(p)
    multi_cli.add_multi_flags(p)
    p.set_defaults(run=run)


def add_target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=list(BACKENDS), default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", help="server to drive (default http://--host:--port; ignored with --backends)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", help="API path (default: the --backend's)")
    p.add_argument("--model", help="model id to send (default: the server's first /v1/models entry); "
                                   "with --backends, the kvlab model preset to serve (default tiny)")
    p.add_argument("--tokenizer", help="kvlab preset or local model whose tokenizer turns prompts into text "
                                       "(default: --model's when it names one, else the byte tokenizer)")
    p.add_argument("--token-ids", action="store_true", help="send prompts as token-id lists, not text")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (always on for the random dataset, as vLLM does)")
    p.add_argument("--connect-timeout", type=float, default=Timeouts.connect, help="seconds (default %(default)s)")
    p.add_argument("--read-timeout", type=float, default=Timeouts.read,
                   help="seconds of silence from the server before a request fails (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=Timeouts.request,
                   help="seconds one request may take in all (default %(default)s)")


def add_dataset_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", "--dataset", dest="dataset",
                   help="random | sharegpt | trace | mooncake[:BLOCK] (these three with --dataset-path) | seed | "
                        "prefix:system|multiturn|fewshot (default random; seed with --backends)")
    p.add_argument("--dataset-path", help="the sharegpt JSON, trace or mooncake JSONL file")
    p.add_argument("--num-prompts", type=int, help="default 1000; 100 with --backends")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=1024)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128)
    p.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="random dataset: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    p.add_argument("--random-prefix-len", dest="prefix_len", type=int, default=0,
                   help="random dataset: tokens of one random prefix before every prompt")
    p.add_argument("--scale", type=float, default=1 / 8, help="seed dataset: multiply every length")
    p.add_argument("--vocab-size", type=int, default=259, help="--token-ids: ids are drawn in [3, vocab-size)")


def add_traffic_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help=f"gamma shape of the gaps (1 = Poisson), in [{checks.MIN_BURSTINESS}, {checks.MAX_BURSTINESS}]")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_result_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentile-metrics", type=flags.parse_list, default=latency.VLLM_METRICS.split(","),
                   help=f"of {','.join(latency.METRICS)} (default {latency.VLLM_METRICS})")
    p.add_argument("--metric-percentiles", type=flags.parse_list, default=latency.VLLM_PERCENTILES.split(","),
                   help=f"(default {latency.VLLM_PERCENTILES})")
    result_file.add_result_file_flags(p)


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", type=flags.parse_list, help="sweep: start a kvlab server per backend")
    p.add_argument("--request-rates", type=flags.parse_list, help="sweep: comma list of rates (inf allowed)")
    p.add_argument("--out", metavar="DIR", help="sweep results directory (default results/<timestamp>)")
    p.add_argument("--server-args", default="", help="sweep: extra `kvlab serve` flags, one string")
    p.add_argument("--repeats", type=int, help="sweep: runs per backend and rate, interleaved (round r runs every "
                                               "backend, in an order that reverses each round); default "
                                               f"{SWEEP_REPEATS} with several backends, else 1")
    p.add_argument("--resume", metavar="DIR", help="sweep: finish the interrupted sweep in DIR: its command line "
                                                   "again, only the runs it does not hold yet")


def dataset_spec(name: str, path: str | None) -> str:
    """vLLM's --dataset-name NAME --dataset-path FILE as kvlab's NAME:FILE (kvlab's own form also accepted)."""
    if not name.strip():
        raise ConfigError("--dataset-name must name a dataset (random, sharegpt, trace, mooncake, seed, prefix:...), "
                          "got an empty name")
    kind = name.partition(":")[0]
    if kind in DATASETS_WITH_FILE and path is None and kind == name:
        raise ConfigError(f"--dataset-name {name} reads a file: give --dataset-path FILE")
    if kind in DATASETS_WITH_FILE and path is not None:
        if kind != name and kind != "mooncake":
            raise ConfigError(f"--dataset-name {name}: give the file once, as --dataset-path")
        return f"{name}:{path}" if kind == name else f"mooncake:{path}:{name.partition(':')[2]}"
    return name


def load_spec_from(args: argparse.Namespace) -> LoadSpec:
    """The one place `kvlab bench serve`'s load flags are read."""
    dataset = dataset_spec(args.dataset, args.dataset_path)
    return LoadSpec(dataset, args.num_prompts, args.seed, args.vocab_size, args.scale, args.input_len,
                    args.output_len, args.range_ratio, args.burstiness, args.max_concurrency, args.model,
                    tuple(args.goodput) if args.goodput is not None else None, tuple(args.percentile_metrics),
                    tuple(args.metric_percentiles), args.prefix_len, args.tokenizer, args.token_ids,
                    args.ignore_eos or dataset == "random")


def run(args: argparse.Namespace) -> int:
    dataset, num_prompts = DEFAULTS["sweep" if args.backends else "run"]
    args.dataset = dataset if args.dataset is None else args.dataset      # "" is refused, not the default
    args.num_prompts = num_prompts if args.num_prompts is None else args.num_prompts
    checks.check_args(args)
    spec = load_spec_from(args)
    if not args.backends and args.resume is not None:
        from kvlab.experiments.reporting.checkpoint import read_header
        read_header(Path(args.resume))          # no sweep there: says so; a sweep's is read by the CLI's main
    if not args.backends and (args.repeats is not None or args.resume is not None):
        raise ConfigError("--repeats and --resume belong to the sweep: give --backends A,B")
    if args.base_urls:
        return multi_cli.run(args, spec)
    if args.backends:
        return sweep(args, spec)
    target = Target(checks.base_url(args), args.backend, checks.check_endpoint(args.endpoint), args.model,
                    timeouts=Timeouts(args.connect_timeout, args.read_timeout, args.request_timeout))
    load_plan(spec, args.request_rate)                  # the dataset's errors before the first request
    target = replace(target, model=args.model or fetch_model(target))
    spec = replace(spec, model=target.model)            # the default tokenizer, as vLLM's: the served model's
    print(start_line(spec, target, args.request_rate), flush=True)
    result = bench_once(spec, target, args.request_rate, progress=not args.disable_tqdm)
    print(format_result(result))
    if result_file.saving(args):
        print(f"wrote {save_result(args, result, target)}")
    return 0 if result["completed"] else 1


def sweep(args: argparse.Namespace, spec: LoadSpec) -> int:
    from kvlab.common.validate import check_int
    from kvlab.experiments.loadgen.sweep import SweepPlan, run_sweep
    checks.check_backends(args.backends)
    repeats = args.repeats if args.repeats is not None else (SWEEP_REPEATS if len(args.backends) > 1 else 1)
    check_int("--repeats", repeats, 1, 1000)
    if args.out is not None:
        check_output_path("--out", args.out, directory=True)
    rates = checks.rates_of(args)
    spec = replace(spec, model=spec.model or "tiny",     # the sweep's tables and plots read p50 and p99 of all
                   percentile_metrics=latency.METRICS, metric_percentiles=("50", "90", "99"))
    load_plan(spec, rates[0])
    plan = SweepPlan(args.backends, rates, repeats, args.server_args_list)
    return run_sweep(spec, plan, args.out, getattr(args, "command_line", []), args.resume)


def start_line(spec: LoadSpec, target: Target, rate: float) -> str:
    prompts = "token ids" if spec.token_ids else "text"
    lengths = f", {spec.input_len} in / {spec.output_len} out tokens" if spec.dataset == "random" else ""
    return (f"kvlab bench serve: {spec.num_prompts} requests ({spec.dataset}, {prompts} prompts{lengths}) at "
            f"{rate:g} req/s, burstiness {spec.burstiness:g}, max concurrency {spec.max_concurrency or 'none'} "
            f"-> {target.url} ({target.backend}, model {target.model})")


def save_result(args: argparse.Namespace, result: dict[str, Any], target: Target) -> Path:
    """vLLM's result file (result_file.py), with kvlab's provenance record."""
    from kvlab.experiments.reporting.provenance import provenance
    record = provenance({"command": "bench serve", "base_url": checks.base_url(args), "load": load_spec_from(args),
                         "request_rate": args.request_rate})
    return result_file.save_result(args, result, target.model or "unknown", record)
