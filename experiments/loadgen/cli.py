"""`kvlab bench serve`: drive an OpenAI-compatible server (--base-url), or, with --backends, start one kvlab server
per backend in turn and sweep --request-rates over identical arrivals and prompts (see sweep.py).

Flag and result-key names follow `vllm bench serve`."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kvlab.experiments.cli import flags
from kvlab.experiments.loadgen import latency
from kvlab.experiments.loadgen.load_run import LoadSpec, bench_once, format_result

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
    p.add_argument("--dataset", default="seed", help="seed | random | trace:FILE.jsonl | "
                   "mooncake:FILE.jsonl[:BLOCK] | prefix:system|multiturn|fewshot")
    p.add_argument("--scale", type=float, default=1 / 8, help="seed dataset: multiply every length")
    p.add_argument("--input-len", type=int, default=64, help="random dataset")
    p.add_argument("--output-len", type=int, default=32, help="random dataset")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths +- this fraction")
    p.add_argument("--vocab-size", type=int, default=259, help="prompt token ids are drawn in [3, vocab-size)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentile-metrics", type=flags.parse_list, default=list(latency.METRICS))
    p.add_argument("--metric-percentiles", type=flags.parse_list, default=["50", "90", "99"])
    p.add_argument("--save-result", action="store_true", help="write the result JSON (--result-dir)")
    p.add_argument("--result-dir", default=".", help="where --save-result writes")
    p.add_argument("--backends", type=flags.parse_list, help="sweep: start a kvlab server per backend")
    p.add_argument("--request-rates", type=flags.parse_list, help="sweep: comma list of rates (inf allowed)")
    p.add_argument("--out", metavar="DIR", help="sweep results directory (default results/<timestamp>)")
    p.add_argument("--server-args", default="", help="sweep: extra `kvlab serve` flags, one string")
    p.set_defaults(run=run)


def load_spec_from(args: argparse.Namespace) -> LoadSpec:
    """The one place `kvlab bench serve`'s load flags are read."""
    return LoadSpec(args.dataset, args.num_prompts, args.seed, args.vocab_size, args.scale, args.input_len,
                    args.output_len, args.range_ratio, args.burstiness, args.max_concurrency, args.model,
                    tuple(args.goodput) if args.goodput is not None else None, tuple(args.percentile_metrics),
                    tuple(args.metric_percentiles))


def run(args: argparse.Namespace) -> int:
    spec = load_spec_from(args)
    if args.backends:
        from kvlab.experiments.loadgen.sweep import parse_rates, run_sweep
        rates = parse_rates(args.request_rates or [str(args.request_rate)])
        return run_sweep(spec, args.backends, rates, args.out, args.server_args)
    result = bench_once(spec, args.base_url or DEFAULT_URL, args.request_rate)
    print(format_result(result))
    if args.save_result:
        path = Path(args.result_dir) / f"kvlab-serve-{args.request_rate:g}qps-{args.num_prompts}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        from kvlab.experiments.reporting.provenance import provenance
        record = provenance({"command": "bench serve", "base_url": args.base_url or DEFAULT_URL, "load": spec,
                             "request_rate": args.request_rate})
        path.write_text(json.dumps({**result, "provenance": record}, indent=1))
        print(f"wrote {path}")
    return 0 if result["completed"] else 1
