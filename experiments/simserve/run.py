"""One serving run on the roofline clock, and the paired grid over backends x rates x seeds.

A point is (backend case, rate, seed). The requests and arrivals depend only on (dataset, rate, seed): every
backend gets the identical schedule (paired seeds). Results carry `kvlab bench serve`'s keys (latency.summarize)
plus the simulator's figures under "sim" and the driver cost ledger under "driver"."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.serve import latency
from kvlab.experiments.serve.arrivals import arrival_times
from kvlab.experiments.serve.datasets import draw_lengths
from kvlab.experiments.serve.load_run import attribution_totals
from kvlab.experiments.simserve.costs import CostLedger, profile
from kvlab.experiments.simserve.early_stop import SloMissed, SloWatch, stopped_result
from kvlab.experiments.simserve.tap import ServeTap
from kvlab.experiments.simulation import SimCase, SimSettings, format_page, run_case
from kvlab.experiments.workload import SEED_MAX_LEN, Request, WorkloadSpec


@dataclass(slots=True)
class ServeSpec:
    """Everything but the backend, rate and seed (picklable: points run in worker processes)."""
    dataset: str = "seed"
    num_requests: int = 2000
    scale: float = 1.0
    max_len: int = SEED_MAX_LEN
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    burstiness: float = 1.0
    hardware: str = "h100"
    model: str = "llama3-8b"
    model_prefill: bool = False
    mfu: float = 0.5
    engine: dict[str, Any] = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = latency.DEFAULT_PERCENTILES
    driver_profile: str = "zero"
    calibration: str | None = None
    background_mapping: bool = False

    def settings(self, seed: int) -> SimSettings:
        workload = WorkloadSpec(num_requests=self.num_requests, seed=seed, scale=self.scale, max_len=self.max_len)
        return SimSettings(workload=workload, hardware=self.hardware, model=self.model,
                           model_prefill=self.model_prefill, mfu=self.mfu, engine=dict(self.engine))


def plan(spec: ServeSpec, rate: float, seed: int) -> list[Request]:
    """The requests and their arrival times: a function of (dataset, rate, burstiness, seed) only."""
    import numpy as np
    lengths, stamps = draw_lengths(spec.dataset, spec.num_requests, np.random.default_rng(seed), spec.scale,
                                   spec.max_len, spec.input_len, spec.output_len, spec.range_ratio)
    if stamps[0] is not None:
        arrivals = stamps
    else:
        arrivals = arrival_times(len(lengths), rate, spec.burstiness, seed).tolist()
    return [Request(int(p), int(o), float(t)) for (p, o), t in zip(lengths, arrivals)]


class TapFactory:
    """Given to run_case: builds the ServeTap around its runner and keeps it."""

    def __init__(self, ledger: CostLedger, watch: SloWatch | None = None) -> None:
        self.ledger, self.watch = ledger, watch
        self.tap: ServeTap | None = None
        self.added: list = []

    def attach(self, runner: Any, cache: Any) -> ServeTap:
        self.tap = ServeTap(runner, cache, self.ledger, self.watch)
        return self.tap


def backend_label(case: SimCase) -> str:
    if case.policy == "reserve":
        return "reserve"
    return case.label


def run_point(case: SimCase, spec: ServeSpec, rate: float, seed: int, stop_on_miss: dict[str, float] | None = None
              ) -> dict[str, Any]:
    """One run. `stop_on_miss` (an SLO): stop as soon as the run certainly misses it (early_stop.py) and return
    only that verdict, marked `stopped_early`."""
    requests = plan(spec, rate, seed)
    prof = profile(spec.driver_profile, spec.calibration, case.page_size)
    watch = (SloWatch(stop_on_miss, [r.arrival_s for r in requests], [r.output_len for r in requests])
             if stop_on_miss else None)
    factory = TapFactory(CostLedger(prof, spec.background_mapping), watch)
    try:
        row = run_case(case, spec.settings(seed), requests, tap=factory)
    except SloMissed as missed:
        return {**stopped_result(missed), "backend": backend_label(case), "request_rate": rate,
                "burstiness": spec.burstiness, "num_prompts": spec.num_requests, "dataset": spec.dataset,
                "seed": seed}
    records = factory.tap.records(factory.added)
    result = latency.summarize(records, row.sim_seconds, spec.goodput or None, percentiles=spec.percentiles,
                               max_concurrent=row.max_batch)
    result.update(attribution_totals(records))     # NaN: the simulator does not attribute memory per request yet
    result.update({"backend": backend_label(case), "request_rate": rate, "burstiness": spec.burstiness,
                   "num_prompts": spec.num_requests, "dataset": spec.dataset, "seed": seed,
                   "server_preemptions": row.preemptions, "sim": row.to_json(), "driver": factory.ledger.to_json(),
                   "pool_create_seconds": prof.create_s * pool_pages(case, spec)})
    return result


def pool_pages(case: SimCase, spec: ServeSpec) -> int:
    """vmm: physical pages created at start-up (K and V per layer share the budget)."""
    if case.policy != "vmm" or not case.page_size:
        return 0
    return int(case.budget_gb * 1e9) // case.page_size


def parse_backends(items: list[str], budget_gb: float, watermark: float) -> list[SimCase]:
    """reserve | oracle | paged-BLOCK | vmm-SIZE (e.g. paged-16, vmm-2MiB, vmm-64KiB)."""
    from kvlab.experiments.cli import parse_bytes
    cases = []
    for item in items:
        name, _, size = item.partition("-")
        if name in ("reserve", "oracle") and not size:
            cases.append(SimCase(name, budget_gb))
        elif name == "paged" and size.isdigit():
            cases.append(SimCase("paged", budget_gb, block_size=int(size), watermark=watermark))
        elif name == "vmm" and size:
            try:
                page = parse_bytes(size)
            except Exception:
                raise ConfigError(f"bad backend {item!r}: vmm-SIZE like vmm-2MiB or vmm-64KiB") from None
            cases.append(SimCase("vmm", budget_gb, page_size=page, watermark=watermark))
        else:
            raise ConfigError(f"bad backend {item!r}: use reserve, oracle, paged-BLOCK (paged-16) or vmm-SIZE "
                              f"(vmm-2MiB)")
    return cases


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


__all__ = ["ServeSpec", "backend_label", "format_page", "parse_backends", "plan", "run_point"]
