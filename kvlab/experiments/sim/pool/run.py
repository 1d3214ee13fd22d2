"""One run of N engines on one GPU under phase-shifted bursts, for one memory arrangement:

- shared:vmm-SIZE: one elastic pool of the total KV budget (shared.py); every engine's address space and
  scheduler see the whole budget, the pool decides who holds it;
- shared:elastic-BLOCK[-SIZE]: the same pool, elastic engines (paged blocks of BLOCK tokens over chunks mapped on
  demand, SIZE pages: 2MiB, the CUDA granularity, unless given), each block pool the whole budget's blocks;
- aware:vmm-SIZE: the same pool, the engines aware of it (a what-if: admission counts the pool's pages,
  VMMAllocator.also_fits in shared.build_cache, and an idle engine waits for pages held by others instead of
  failing the request);
- split:BACKEND: a static equal split, each engine a cache of total / N (paged, vmm or reserve).

The result has each model's figures (`kvlab bench serve`'s keys, SLO attainment, pages moved to it) and, at the
top, every latency figure's worst value over the models: a point meets an SLO when every model does."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen import latency
from kvlab.experiments.loadgen.datasets import draw_lengths
from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.fleet import SimEngine, SimGpu, build_engine, drive
from kvlab.experiments.sim.pool.onoff import OnOff
from kvlab.experiments.sim.pool.shared import PooledAccountingMemory, SharedPages, build_cache, build_elastic_cache
from kvlab.experiments.sim.pool.tap import PoolTap
from kvlab.experiments.sim.serve.costs import CostLedger, profile
from kvlab.experiments.sim.serve.early_stop import SloMissed, stopped_result
from kvlab.experiments.sim.serve.run import ServeSpec, parse_backends, watch
from kvlab.experiments.workloads.requests import Request

KINDS = ("shared", "aware", "split")
POOL_PAGE = 2 * 2**20     # an elastic engine's pool page unless given: the CUDA granularity, as vmm-2MiB's


@dataclass(frozen=True, slots=True)
class Arrangement:
    kind: str           # shared | aware | split
    case: SimCase       # the backend, its budget the TOTAL KV budget

    @property
    def label(self) -> str:
        return f"{self.kind} {self.case.backend_label}"

    def engine_case(self, models: int) -> SimCase:
        """Each engine's case: the whole budget on the pool (its address space), else its equal share."""
        if self.kind != "split":
            return self.case
        c = self.case
        return SimCase(c.policy, c.budget_gb / models, watermark=c.watermark, **c.options)


def parse_arrangements(items: list[str], budget_gb: float, watermark: float) -> list[Arrangement]:
    """shared:vmm-SIZE | shared:elastic-BLOCK[-SIZE] | aware:vmm-SIZE | split:BACKEND (BACKEND as `simulate serve`'s:
    paged-16, vmm-2MiB, elastic-16, reserve)."""
    out = []
    for item in items:
        kind, sep, backend = item.partition(":")
        if not sep or kind not in KINDS:
            raise ConfigError(f"bad arrangement {item!r}: use shared:vmm-SIZE, shared:elastic-BLOCK, aware:vmm-SIZE "
                              "or split:BACKEND (e.g. shared:vmm-2MiB, shared:elastic-16, split:paged-16)")
        case = parse_backends([backend], budget_gb, watermark)[0]
        if kind != "split" and not (case.policy == "vmm" or (kind == "shared" and case.policy == "elastic")):
            raise ConfigError(f"bad arrangement {item!r}: only vmm engines can share a pool ({kind}:vmm-SIZE), "
                              "and elastic ones without pool-aware admission (shared:elastic-BLOCK)")
        if kind == "shared" and case.policy == "elastic" and "elastic_page_size" not in case.options:
            case = SimCase(case.policy, case.budget_gb, watermark=case.watermark,
                           **{**case.options, "elastic_page_size": POOL_PAGE})
        out.append(Arrangement(kind, case))
    return out


def pool_page_size(case: SimCase) -> int:
    """The pool's page: the vmm engines' page, or the elastic engines' (one ledger, one page size)."""
    return case.options["elastic_page_size" if case.policy == "elastic" else "page_size"]


@dataclass(slots=True)
class PoolSpec:
    """Everything but the arrangement, total rate and seed (picklable)."""
    serve: ServeSpec
    onoff: OnOff
    slo: dict[str, float] = field(default_factory=dict)

    @property
    def models(self) -> int:
        return self.onoff.models

    @property
    def request_limits(self) -> dict[str, float]:
        """Each request's TTFT / TPOT limits for SLO attainment (ms): --goodput's, else the SLO's TTFT and TPOT."""
        if self.serve.goodput:
            return {k: v for k, v in self.serve.goodput.items() if k in ("ttft", "tpot")}
        return {metric: ms for key, ms in self.slo.items() for metric in ("ttft", "tpot") if f"_{metric}_" in key}


def plan_models(spec: PoolSpec, total_rate: float, seed: int) -> list[list[Request]]:
    """Each model's requests: its on/off arrivals, lengths drawn from (seed, model)."""
    s = spec.serve
    plans = []
    for model in range(spec.models):
        times = spec.onoff.arrivals(model, total_rate, seed)
        rng = np.random.default_rng([seed, model, 1])
        lengths = draw_lengths(s.dataset, len(times), rng, s.scale, s.max_len, s.input_len, s.output_len,
                               s.range_ratio)[0] if times else []
        plans.append([Request(p, o, t) for (p, o), t in zip(lengths, times)])
    return plans


def build(arr: Arrangement, spec: PoolSpec, plans: list[list[Request]], seed: int,
          stop: dict[str, float] | None) -> tuple[list[SimEngine], SharedPages | None]:
    s = spec.serve
    settings = s.settings(seed)
    everything = [r for p in plans for r in p]        # sizes every engine's scheduler limits alike
    options = arr.case.options
    prof = profile(s.driver_profile, s.calibration, options.get("page_size", options.get("elastic_page_size")))
    # per-run cuMemSetAccess: simulate pool keeps its driver axes; simulate serve's per-page default is not its own
    case = arr.engine_case(spec.models)
    pool = SharedPages(int(case.budget_gb * 1e9) // pool_page_size(case)) if arr.kind != "split" else None
    engines = []
    try:
        for i, plan in enumerate(plans):
            engines.append(build_engine(f"model{i}", case, settings, everything,
                                        CostLedger(prof, s.background_mapping, "per-run"),
                                        s.model_prefill, watch(stop, plan, settings) if plan else None,
                                        pooled_cache(pool, arr.kind == "aware", case.policy), PoolTap))
    except BaseException:
        for e in engines:
            e.close()
        raise
    if arr.kind == "aware":
        for e in engines:
            e.holds_back = waits_for_pool(e.engine, pool)
    return engines, pool


def waits_for_pool(engine: Any, pool: SharedPages) -> Callable[[], bool]:
    """The what-if's other half: an engine with nothing running whose next request the pool could hold but cannot
    now (other engines' running requests hold the pages) waits for them, instead of stepping, where its scheduler
    would fail the request as one that "does not fit even in an empty cache" (true of a private cache only)."""
    queues, allocator = engine.scheduler.queues, engine.cache.allocator

    def waits() -> bool:
        if queues.running:
            return False
        head = queues.swapped[0] if queues.swapped else queues.next_waiting()
        if head is None:
            return False
        need = allocator.units_needed(head, head.num_tokens) * allocator.geo.num_tensors
        return pool.obtainable() < need <= pool.pages
    return waits


def pooled_cache(pool: SharedPages | None, aware: bool, policy: str = "vmm") -> Any:
    """The cache maker of an engine on `pool` (None: the backend's own cache)."""
    if pool is None:
        return None
    if policy == "elastic":
        return lambda config, shape: build_elastic_cache(
            config, shape, PooledAccountingMemory(config.options_of("elastic").elastic_page_size, pool.join(), True))
    return lambda config, shape: build_cache(config, shape, PooledAccountingMemory(config.options_of("vmm").page_size,
                                                                                   pool.join()), aware)


def run_point(arr: Arrangement, spec: PoolSpec, total_rate: float, seed: int,
              stop_on_miss: dict[str, float] | None = None) -> dict[str, Any]:
    plans = plan_models(spec, total_rate, seed)
    point = {"arrangement": arr.label, "total_rate": total_rate, "seed": seed, "models": spec.models,
             "num_prompts": sum(map(len, plans))}
    if not point["num_prompts"]:
        raise ConfigError(f"total rate {total_rate:g}/s sends no request in {spec.onoff.duration_s:g} s; raise it")
    engines, pool = build(arr, spec, plans, seed, stop_on_miss)
    try:
        for engine, plan in zip(engines, plans):
            for r in plan:
                engine.send(r, r.arrival_s)
        end = drive([SimGpu(engines)])
        return {**point, **summarize(engines, spec, end), "pages_moved": pool.pages_moved if pool else 0}
    except SloMissed as missed:
        return {**stopped_result(missed), **point}
    finally:
        for e in engines:
            e.close()


def model_result(engine: SimEngine, spec: PoolSpec, duration: float) -> dict[str, Any]:
    records = engine.tap.records(engine.added, engine.finished)
    s = spec.serve
    result = latency.summarize(records, duration, s.goodput or None, percentiles=s.percentiles)
    result["slo_attainment"] = attainment(records, spec.request_limits)
    share = getattr(engine.tap, "share", None)
    result["pages_received"] = share.unmapped_for_me if share is not None else 0
    metrics = engine.engine.metrics()
    result.update(server_preemptions=metrics.preemptions, recomputed_tokens=metrics.recomputed_tokens,
                  driver=engine.tap.ledger.to_json())
    return result


def attainment(records: list[latency.RequestRecord], limits: dict[str, float]) -> float | None:
    """The share of requests whose own TTFT and TPOT are within `limits` (ms; None: no limit, or no request)."""
    if not limits or not records:
        return None
    return sum(r.success and latency.meets(r, limits) for r in records) / len(records)


def summarize(engines: list[SimEngine], spec: PoolSpec, end: float) -> dict[str, Any]:
    per_model = [model_result(e, spec, end) for e in engines]
    worst: dict[str, Any] = {key: worst_of([m[key] for m in per_model]) for key in per_model[0]
                             if key.endswith("_ms")}
    worst["failed"] = sum(m["failed"] for m in per_model)
    worst["request_throughput"] = sum(m["request_throughput"] for m in per_model)
    attained = [m["slo_attainment"] for m in per_model if m["slo_attainment"] is not None]
    worst["min_slo_attainment"] = min(attained) if attained else None
    return {**worst, "duration": end, "per_model": per_model}


def worst_of(values: list[float]) -> float:
    """The largest value; NaN (no sample) only when every model has none."""
    known = [v for v in values if v == v]
    return max(known) if known else math.nan
