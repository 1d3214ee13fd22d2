"""One measured load run against an OpenAI-compatible server: the plan (prompts and arrivals, from the flags and
seed only) and the vLLM-named result. Shared by `kvlab bench serve` and the paired sweep."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen import datasets, latency
from kvlab.experiments.loadgen.arrivals import arrival_times
from kvlab.experiments.loadgen.client import run_load


@dataclass(frozen=True)
class LoadSpec:
    """What one load run sends and measures, built once from `kvlab bench serve`'s flags (loadgen/cli.py)."""
    dataset: str = "seed"
    num_prompts: int = 100
    seed: int = 0
    vocab_size: int = 259
    scale: float = 1 / 8
    input_len: int = 64
    output_len: int = 32
    range_ratio: float = 0.0
    burstiness: float = 1.0
    max_concurrency: int | None = None
    model: str | None = None         # the model id sent (None: the server's first /v1/models entry)
    goodput: tuple[str, ...] | None = None
    percentile_metrics: tuple[str, ...] = tuple(latency.METRICS)
    metric_percentiles: tuple[str, ...] = ("50", "90", "99")


def load_plan(spec: LoadSpec, rate: float) -> tuple[list[datasets.LoadRequest], list[float]]:
    """Prompts and arrivals depend only on the spec and seed: every backend and rerun gets the same."""
    reqs = datasets.build(spec.dataset, spec.num_prompts, spec.seed, spec.vocab_size, scale=spec.scale,
                          input_len=spec.input_len, output_len=spec.output_len, range_ratio=spec.range_ratio)
    if reqs[0].timestamp is not None:
        return reqs, [r.timestamp for r in reqs]
    return reqs, arrival_times(len(reqs), rate, spec.burstiness, spec.seed).tolist()


def bench_once(spec: LoadSpec, base_url: str, rate: float, model: str | None = None) -> dict[str, Any]:
    try:
        percentiles = tuple(float(p) for p in spec.metric_percentiles)
    except ValueError:
        raise ConfigError(f"bad --metric-percentiles {list(spec.metric_percentiles)}: numbers like 50,90,99") from None
    slos = latency.parse_goodput(list(spec.goodput) if spec.goodput is not None else None)
    reqs, arrivals = load_plan(spec, rate)
    records, duration, peak = asyncio.run(run_load(base_url, reqs, arrivals, spec.max_concurrency,
                                                   model if model is not None else spec.model))
    result = latency.summarize(records, duration, slos, spec.percentile_metrics, percentiles, peak)
    result.update({"request_rate": rate, "burstiness": spec.burstiness, "max_concurrency": spec.max_concurrency,
                   "num_prompts": spec.num_prompts, "dataset": spec.dataset, "seed": spec.seed,
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
