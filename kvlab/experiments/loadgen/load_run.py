"""One measured load run against an OpenAI-compatible server: the plan (prompts and arrivals, from the flags and
seed only) and the vLLM-named result. Shared by `kvlab bench serve` and the paired sweep."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_number
from kvlab.experiments.limits import MAX_SPAN_S
from kvlab.experiments.loadgen import datasets, latency, prompts
from kvlab.experiments.loadgen.arrivals import arrival_times
from kvlab.experiments.loadgen.client import Target, run_load
from kvlab.experiments.loadgen.rows import attribution_totals, request_log
from kvlab.experiments.reporting.tables import progress_bar


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
    prefix_len: int = 0
    tokenizer: str | None = None     # preset or local model whose tokenizer makes text prompts (None: --model's)
    token_ids: bool = True           # send token-id lists, not text
    ignore_eos: bool = True


def load_requests(spec: LoadSpec) -> list[datasets.LoadRequest]:
    """The spec's prompts and output lengths, from the spec and seed only."""
    tokenizer = None if spec.token_ids else prompts.load_tokenizer(spec.tokenizer or spec.model,
                                                                    explicit=spec.tokenizer is not None)
    return datasets.build(spec.dataset, spec.num_prompts, spec.seed, spec.vocab_size, scale=spec.scale,
                          input_len=spec.input_len, output_len=spec.output_len, range_ratio=spec.range_ratio,
                          prefix_len=spec.prefix_len, tokenizer=tokenizer)


def load_plan(spec: LoadSpec, rate: float) -> tuple[list[datasets.LoadRequest], list[float]]:
    """Prompts and arrivals depend only on the spec and seed: every backend and rerun gets the same."""
    reqs = load_requests(spec)
    if reqs[0].timestamp is not None:
        return reqs, [r.timestamp for r in reqs]
    arrivals = arrival_times(len(reqs), rate, spec.burstiness, spec.seed)
    check_number("the arrivals' span (--num-prompts / --request-rate)", float(arrivals[-1]), 0.0, MAX_SPAN_S,
                 unit=" s")
    return reqs, arrivals.tolist()


def bench_once(spec: LoadSpec, target: Target | str, rate: float, model: str | None = None,
               progress: bool = False) -> dict[str, Any]:
    """One run; the result has `vllm bench serve`'s keys (per request: input_lens, output_lens, ttfts, itls,
    generated_texts, errors) plus kvlab's (the server's KV attribution, `requests`)."""
    target = Target(target) if isinstance(target, str) else target
    try:
        percentiles = tuple(float(p) for p in spec.metric_percentiles)
    except ValueError:
        raise ConfigError(f"bad --metric-percentiles {list(spec.metric_percentiles)}: numbers like 50,90,99") from None
    slos = latency.parse_goodput(list(spec.goodput) if spec.goodput is not None else None)
    reqs, arrivals = load_plan(spec, rate)
    target = replace(target, ignore_eos=spec.ignore_eos)
    with progress_bar(total=len(reqs), disable=not progress, unit="req") as bar:
        records, duration, peak = asyncio.run(run_load(target, reqs, arrivals, spec.max_concurrency,
                                                       model if model is not None else spec.model,
                                                       on_done=lambda _: bar.update()))
    result = latency.summarize(records, duration, slos, spec.percentile_metrics, percentiles, peak)
    result.update({"request_rate": rate, "burstiness": spec.burstiness, "max_concurrency": spec.max_concurrency,
                   "num_prompts": spec.num_prompts, "dataset": spec.dataset, "seed": spec.seed})
    result.update(per_request(records))
    result.update(attribution_totals(records))
    result["requests"] = [request_log(r) for r in records]
    return result


def per_request(records: list[latency.RequestRecord]) -> dict[str, list]:
    """vLLM's per-request lists, in request order (a failed request: 0 output tokens, TTFT 0, error text)."""
    return {"input_lens": [r.prompt_len for r in records],
            "output_lens": [r.output_tokens if r.success else 0 for r in records],
            "ttfts": [r.ttft for r in records], "itls": [r.itl for r in records],
            "generated_texts": [r.generated_text for r in records], "errors": [r.error for r in records]}




def format_result(r: dict[str, Any]) -> str:
    keys = [k for k in r if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)]
    failures = sorted({e for e in r.get("errors", []) if e})[:5]
    keys += ["errors"] if failures else []
    r = r | {"errors": "; ".join(failures)}
    return "\n".join(f"{k:<32} {r[k]:.3f}" if isinstance(r[k], float) else f"{k:<32} {r[k]}" for k in keys)
