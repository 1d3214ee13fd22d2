"""`kvlab bench serve`: drive an OpenAI-compatible server (--base-url), or, with --backends, start one kvlab server
per backend in turn and sweep --request-rates over identical arrivals and prompts (see sweep.py).

Flag and result-key names follow `vllm bench serve`."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments import cli
from kvlab.experiments.serve import datasets, latency
from kvlab.experiments.serve.arrivals import arrival_times
from kvlab.experiments.serve.client import run_load

DEFAULT_URL = "http://127.0.0.1:8000"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="load generator for an OpenAI-compatible server; --backends sweeps",
                              description=__doc__)
    p.add_argument("--base-url", help=f"server to drive (default {DEFAULT_URL}; ignored with --backends)")
    p.add_argument("--model", help="model id to send (default: the server's first /v1/models entry); "
                                   "with --backends, the kvlab model preset to serve (default tiny)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="seed", help="seed | random | trace:FILE.jsonl")
    p.add_argument("--scale", type=float, default=1 / 8, help="seed dataset: multiply every length")
    p.add_argument("--input-len", type=int, default=64, help="random dataset")
    p.add_argument("--output-len", type=int, default=32, help="random dataset")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths +- this fraction")
    p.add_argument("--vocab-size", type=int, default=259, help="prompt token ids are drawn in [3, vocab-size)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentile-metrics", type=cli.parse_list, default=list(latency.METRICS))
    p.add_argument("--metric-percentiles", type=cli.parse_list, default=["50", "90", "99"])
    p.add_argument("--save-result", action="store_true", help="write the result JSON (--result-dir)")
    p.add_argument("--result-dir", default=".", help="where --save-result writes")
    p.add_argument("--backends", type=cli.parse_list, help="sweep: start a kvlab server per backend")
    p.add_argument("--request-rates", type=cli.parse_list, help="sweep: comma list of rates (inf allowed)")
    p.add_argument("--out", metavar="DIR", help="sweep results directory (default results/<timestamp>)")
    p.add_argument("--server-args", default="", help="sweep: extra `kvlab serve` flags, one string")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.backends:
        from kvlab.experiments.serve.sweep import run_sweep
        return run_sweep(args)
    result = bench_once(args, args.base_url or DEFAULT_URL, args.request_rate)
    print(format_result(result))
    if args.save_result:
        path = Path(args.result_dir) / f"kvlab-serve-{args.request_rate:g}qps-{args.num_prompts}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    return 0 if result["completed"] else 1


def load_plan(args: argparse.Namespace, rate: float) -> tuple[list[datasets.LoadRequest], list[float]]:
    """Prompts and arrivals depend only on the flags and seed: every backend and rerun gets the same."""
    reqs = datasets.build(args.dataset, args.num_prompts, args.seed, args.vocab_size, scale=args.scale,
                          input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio)
    if reqs[0].timestamp is not None:
        return reqs, [r.timestamp for r in reqs]
    return reqs, arrival_times(len(reqs), rate, args.burstiness, args.seed).tolist()


def bench_once(args: argparse.Namespace, base_url: str, rate: float, model: str | None = None) -> dict[str, Any]:
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles)
    except ValueError:
        raise ConfigError(f"bad --metric-percentiles {args.metric_percentiles}: numbers like 50,90,99") from None
    slos = latency.parse_goodput(args.goodput)
    reqs, arrivals = load_plan(args, rate)
    records, duration, peak = asyncio.run(run_load(base_url, reqs, arrivals, args.max_concurrency,
                                                   model if model is not None else args.model))
    result = latency.summarize(records, duration, slos, tuple(args.percentile_metrics), percentiles, peak)
    result.update({"request_rate": rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                   "num_prompts": args.num_prompts, "dataset": args.dataset, "seed": args.seed,
                   "errors": sorted({r.error for r in records if r.error})[:5]})
    return result


def format_result(r: dict[str, Any]) -> str:
    keys = [k for k in r if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)]
    return "\n".join(f"{k:<32} {r[k]:.3f}" if isinstance(r[k], float) else f"{k:<32} {r[k]}" for k in keys)
