"""One measured load run against an OpenAI-compatible server: the plan (prompts and arrivals, from the flags and
seed only) and the vLLM-named result. Shared by `kvlab bench serve` and the paired sweep."""
from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen import datasets, latency
from kvlab.experiments.loadgen.arrivals import arrival_times
from kvlab.experiments.loadgen.client import run_load


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
    result.update(attribution_totals(records))
    result["requests"] = [request_log(r) for r in records]
    return result


ATTRIBUTED = ("kv_wait_s", "num_preemptions", "recomputed_tokens", "map_unmap_s")


def request_log(r: latency.RequestRecord) -> dict[str, Any]:
    """One request of the run: client timings plus the server's KV attribution (absent for a non-kvlab server)."""
    return {"start_s": r.start, "ttft_s": r.ttft, "e2el_s": r.latency, "prompt_len": r.prompt_len,
            "output_tokens": r.output_tokens, "success": r.success, "error": r.error} | \
        {k: r.kvlab.get(k) for k in ATTRIBUTED}


def attribution_totals(records: list[latency.RequestRecord]) -> dict[str, float]:
    """Sums over the run's requests of what the server attributed to each (NaN when it reported nothing)."""
    seen = [r.kvlab for r in records if r.kvlab]
    return {f"total_{k}": (sum(e.get(k) or 0 for e in seen) if seen else math.nan) for k in ATTRIBUTED}


def format_result(r: dict[str, Any]) -> str:
    keys = [k for k in r if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)]
    return "\n".join(f"{k:<32} {r[k]:.3f}" if isinstance(r[k], float) else f"{k:<32} {r[k]}" for k in keys)
