"""`kvlab bench serve --base-urls`: several servers, one model each, driven at once on one clock by phase-shifted
bursts (phases.py), each server's /kvlab/stats sampled meanwhile. Per model: vLLM's latency keys (latency.py),
the SLO attainment, its bursts and its requests; per server: the sampled series its memory share is read from
(shares.py)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen import latency
from kvlab.experiments.loadgen.client import Target, run_load
from kvlab.experiments.loadgen.datasets import LoadRequest
from kvlab.experiments.loadgen.load_run import LoadSpec, load_requests
from kvlab.experiments.loadgen.phases import Phases
from kvlab.experiments.loadgen.rows import attribution_totals, request_log
from kvlab.experiments.loadgen.sampler import StatsSampler
from kvlab.experiments.reporting.tables import progress_bar

LEAD_S = 0.5          # from setting the shared clock to arrival 0.0: every stream's client is ready by then

Plan = tuple[list[LoadRequest], list[float]]


@dataclass(frozen=True, slots=True)
class MultiSpec:
    """What a multi-model run sends: the phases, and the prompts and metrics every model shares (`load`'s
    num_prompts is set per model from its arrivals)."""
    phases: Phases
    load: LoadSpec


def model_plans(multi: MultiSpec) -> list[Plan]:
    """Each model's prompts (seeded by seed + model) and arrivals; the same for every configuration of an A/B."""
    return [model_plan(multi, i) for i in range(multi.phases.models)]


def model_plan(multi: MultiSpec, model: int) -> Plan:
    arrivals = multi.phases.arrivals(model, multi.load.seed)
    if not arrivals:
        raise ConfigError(f"model {model} gets no request in {multi.phases.duration_s:g} s: raise --burst-rate, "
                          "--duty-cycle or --period")
    reqs = load_requests(replace(multi.load, num_prompts=len(arrivals), seed=multi.load.seed + model))
    if reqs[0].timestamp is not None:
        raise ConfigError(f"--dataset-name {multi.load.dataset} brings its own arrival times; the multi-model mode "
                          "draws them from the phases: use random, seed, sharegpt or prefix:...")
    return reqs, arrivals


def start_clock() -> float:
    """The time.perf_counter() a run's arrival 0.0 will mean: LEAD_S from now."""
    return time.perf_counter() + LEAD_S


def run_multi(multi: MultiSpec, targets: list[Target], progress: bool = False, t0: float | None = None
              ) -> dict[str, Any]:
    """Every model's stream against its server at once; targets carry their model ids. `t0`: start_clock()'s
    value when the caller samples something else on the same clock."""
    plans = model_plans(multi)
    slos = latency.parse_goodput(list(multi.load.goodput) if multi.load.goodput is not None else None)
    t0 = start_clock() if t0 is None else t0
    samplers = [StatsSampler(t.base_url, t0=t0) for t in targets]
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(progress_bar(total=sum(len(r) for r, _ in plans), disable=not progress,
                                               unit="req"))
        for sampler in samplers:
            stack.enter_context(sampler)
        runs = asyncio.run(all_streams(targets, plans, multi.load.max_concurrency, t0, lambda _: bar.update()))
    models = [model_block(multi, i, t, run, slos) for i, (t, run) in enumerate(zip(targets, runs))]
    return {"models": models, "samples": [s.series for s in samplers], "sample_errors": [s.errors for s in samplers]}


async def all_streams(targets: list[Target], plans: list[Plan], max_concurrency: int | None, t0: float,
                      on_done: Any) -> list[tuple[list[latency.RequestRecord], float, int]]:
    return await asyncio.gather(*(run_load(t, reqs, arrivals, max_concurrency, t.model, on_done, start_at=t0)
                                  for t, (reqs, arrivals) in zip(targets, plans)))


def model_block(multi: MultiSpec, index: int, target: Target, run: tuple[list[latency.RequestRecord], float, int],
                slos: dict[str, float]) -> dict[str, Any]:
    """One model's result: vLLM's summary keys, the server's KV attribution summed over its requests (kv wait,
    preemptions, recomputed tokens, map/unmap seconds), its SLO attainment, its bursts and its requests."""
    records, duration, peak = run
    percentiles = tuple(float(p) for p in multi.load.metric_percentiles)
    block = latency.summarize(records, duration, slos, multi.load.percentile_metrics, percentiles, peak)
    return {"model_index": index, "model_id": target.model, "base_url": target.base_url,
            "num_prompts": len(records)} | block | attribution_totals(records) | {
        "slo_attainment": attainment(records, slos), "bursts": multi.phases.bursts(index),
        "requests": [request_log(r) for r in records]}


def attainment(records: list[latency.RequestRecord], slos: dict[str, float]) -> float | None:
    """The fraction of all sent requests that completed within every SLO (None without SLOs); a failed
    request misses."""
    if not slos:
        return None
    return sum(r.success and latency.meets(r, slos) for r in records) / len(records)


def summary_line(block: dict[str, Any]) -> str:
    slo = block["slo_attainment"]
    within = f", {slo:.1%} within the SLOs" if slo is not None else ""
    p99 = ", ".join(f"p99 {m.upper()} {block[f'p99_{m}_ms']:.1f} ms" for m in ("ttft", "tpot")
                    if f"p99_{m}_ms" in block)
    return (f"model {block['model_index']} ({block['model_id']} at {block['base_url']}): {block['completed']}/"
            f"{block['num_prompts']} done, {p99}{within}")
