"""One serving run on the roofline clock, and the paired grid over backends x rates x seeds.

A point is (backend case, rate, seed). The requests and arrivals depend only on (dataset, rate, seed): every
backend gets the identical schedule (paired seeds). Results carry `kvlab bench serve`'s keys (latency.summarize)
plus the simulator's figures under "sim" and the driver cost ledger under "driver"."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import is_digits, shown
from kvlab.experiments.loadgen import latency
from kvlab.experiments.loadgen.arrivals import arrival_times
from kvlab.experiments.loadgen.datasets import draw_lengths
from kvlab.experiments.loadgen.rows import attribution_totals, request_log
from kvlab.experiments.sim.collector import collector_paused
from kvlab.experiments.sim.core import SimCase, SimSettings, format_page, run_case
from kvlab.experiments.sim.serve.costs import CostLedger, DriverProfile, profile
from kvlab.experiments.sim.serve.early_stop import SloMissed, SloWatch, stopped_result
from kvlab.experiments.sim.serve.tap import ServeTap
from kvlab.experiments.workloads.requests import SEED_MAX_LEN, Request, WorkloadSpec

SHARE_KEYS = ("attention_share", "driver_share", "other_share")    # of the run's summed step time


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
    background_mapping: bool = True    # vmm maps ahead on a worker thread (vAttention's step_async); False: none
    set_access: str = "per-page"       # cuMemSetAccess per page mapped (vAttention's code) or per-run (costs.py)
    layout_penalty: str = "none"       # a cross-layer vmm case's attention penalty: none | kvcached (layouts.py)
    tensor_parallel_size: int = 1      # budgets per GPU; costs and KV per rank (docs/tensor-parallel.md)
    max_concurrency: int = 0           # client-side limit on requests in flight (0 = none)
    kernel_costs: str = "none"         # the kernel term's profile (experiments/sim/kernels.py)

    def settings(self, seed: int, max_concurrency: int | None = None) -> SimSettings:
        workload = WorkloadSpec(num_requests=self.num_requests, seed=seed, scale=self.scale, max_len=self.max_len)
        limit = self.max_concurrency if max_concurrency is None else max_concurrency
        return SimSettings(workload=workload, hardware=self.hardware, model=self.model,
                           model_prefill=self.model_prefill, mfu=self.mfu, engine=dict(self.engine),
                           tensor_parallel_size=self.tensor_parallel_size, max_concurrency=limit,
                           kernel_costs=self.kernel_costs, layout_penalty=self.layout_penalty)

    def ledger(self, prof: DriverProfile) -> CostLedger:
        """A driver-cost ledger for `prof` with this spec's driver axes: overlap and set-access granularity."""
        return CostLedger(prof, self.background_mapping, self.set_access)


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
        self.finished: dict[str, Any] = {}

    def attach(self, runner: Any, cache: Any, layers_per_page: int = 1) -> ServeTap:
        self.tap = ServeTap(runner, cache, self.ledger, self.watch, layers_per_page)
        return self.tap

    def bind(self, engine: Any) -> None:
        self.tap.bind(engine)


def backend_label(case: SimCase) -> str:
    return case.backend_label


def run_point(case: SimCase, spec: ServeSpec, rate: float, seed: int, max_concurrency: int | None = None,
              stop_on_miss: dict[str, float] | None = None) -> dict[str, Any]:
    """One run; `max_concurrency` overrides the spec's (the concurrency search's axis). `stop_on_miss` (an SLO):
    stop as soon as the run certainly misses it (early_stop.py) and return only that verdict, `stopped_early`."""
    settings = spec.settings(seed, max_concurrency)
    point = {"backend": backend_label(case), "request_rate": rate, "burstiness": spec.burstiness,
             "max_concurrency": settings.max_concurrency or None, "num_prompts": spec.num_requests,
             "dataset": spec.dataset, "seed": seed}
    with collector_paused():
        requests = plan(spec, rate, seed)
        prof = profile(spec.driver_profile, spec.calibration, case.options.get("page_size"))
        factory = TapFactory(spec.ledger(prof), watch(stop_on_miss, requests, settings))
        return measured(case, spec, settings, requests, factory, point)


def measured(case: SimCase, spec: ServeSpec, settings: SimSettings, requests: list[Request], factory: TapFactory,
             point: dict[str, Any]) -> dict[str, Any]:
    """The run's figures and `point` (what it was), or only its verdict when it stopped early."""
    try:
        row = run_case(case, settings, requests, tap=factory)
    except SloMissed as missed:
        return {**stopped_result(missed), **point}
    records = factory.tap.records(factory.added, factory.finished)
    result = latency.summarize(records, row.sim_seconds, spec.goodput or None, percentiles=spec.percentiles,
                               max_concurrent=row.max_batch)
    result.update(attribution_totals(records))
    result["total_map_unmap_exposed_s"] = sum(r.kvlab["map_unmap_exposed_s"] for r in records)
    result["total_client_wait_s"] = sum(r.start - req.arrival_s for r, (_, req) in zip(records, factory.added))
    driver = factory.ledger.to_json() | {"driver_unattributed_seconds": factory.tap.unattributed_s}
    result.update({key: getattr(row, key) for key in SHARE_KEYS})
    result.update({**point, "server_preemptions": row.preemptions, "sim": row.to_json(), "driver": driver,
                   "pool_create_seconds": factory.ledger.profile.create_s * pool_pages(case, spec),
                   "requests": [request_log(r) for r in records]})
    return result


def watch(slo: dict[str, float] | None, requests: list[Request], settings: SimSettings) -> SloWatch | None:
    """The early-stop watch for `slo`. Under a client concurrency cap TTFT counts from the send, not the planned
    arrival, so only the TPOT targets can stop such a run."""
    if not slo:
        return None
    if settings.max_concurrency:
        slo = {k: v for k, v in slo.items() if "_ttft_" not in k}
    return SloWatch(slo, [r.arrival_s for r in requests], [r.output_len for r in requests])


def pool_pages(case: SimCase, spec: ServeSpec) -> int:
    """vmm: physical pages created at start-up (K and V per layer share the budget)."""
    page_size = case.options.get("page_size")
    if case.policy != "vmm" or not page_size:
        return 0
    return int(case.budget_gb * 1e9) // page_size


MAX_UNIT_TOKENS = 1 << 20          # a paged block's tokens
MAX_PAGE_BYTES = 1 << 40           # a vmm page's bytes


def parse_backends(items: list[str], budget_gb: float, watermark: float,
                   layouts: tuple[str, ...] = ("per-layer",)) -> list[SimCase]:
    """reserve | oracle | paged-BLOCK | vmm-SIZE[-crosslayer] | elastic-BLOCK[-SIZE] (e.g. paged-16, vmm-2MiB,
    vmm-2MiB-crosslayer, elastic-16-2MiB). A vmm-SIZE without a layout runs once in each of `layouts` (simulate
    serve's --vmm-layout)."""
    cases = []
    for item in items:
        name, _, size = item.partition("-")
        if name in ("reserve", "oracle") and not size:
            cases.append(SimCase(name, budget_gb))
        elif name == "paged" and is_digits(size) and 0 < int(size) <= MAX_UNIT_TOKENS:
            cases.append(SimCase("paged", budget_gb, block_size=int(size), watermark=watermark))
        elif name == "elastic" and size:
            cases.append(elastic_case(item, size, budget_gb, watermark))
        elif name == "vmm" and size:
            cases += vmm_cases(item, size, budget_gb, watermark, layouts)
        else:
            raise ConfigError(f"bad backend {shown(item)}: use reserve, oracle, paged-BLOCK (paged-16, a block of "
                              f"1 to {MAX_UNIT_TOKENS} tokens), vmm-SIZE (vmm-2MiB, vmm-2MiB-crosslayer) or "
                              f"elastic-BLOCK[-SIZE] (elastic-16-2MiB)")
    return cases


def vmm_cases(item: str, size: str, budget_gb: float, watermark: float, layouts: tuple[str, ...]) -> list[SimCase]:
    from kvlab.experiments.cli.flags import parse_bytes
    from kvlab.experiments.sim.layouts import CROSS_LAYER, LAYOUT_OPTION, check_layout
    if size.endswith("-crosslayer"):
        size, layouts = size.removesuffix("-crosslayer"), (CROSS_LAYER,)
    try:
        page = parse_bytes(size)
    except Exception:                       # noqa: BLE001 - any unreadable size is the message below
        page = 0
    if not 0 < page <= MAX_PAGE_BYTES:      # a page of 0 bytes divided by zero later
        raise ConfigError(f"bad backend {shown(item)}: vmm-SIZE like vmm-2MiB or vmm-64KiB, a page of "
                          f"1 byte to {MAX_PAGE_BYTES >> 30} GiB")
    out = []
    for layout in layouts:
        extra = {LAYOUT_OPTION: CROSS_LAYER} if check_layout(layout) == CROSS_LAYER else {}
        out.append(SimCase("vmm", budget_gb, page_size=page, watermark=watermark, **extra))
    return out


def elastic_case(item: str, size: str, budget_gb: float, watermark: float) -> SimCase:
    """elastic-BLOCK[-SIZE]: paged blocks of BLOCK tokens over pages of SIZE (default: the backend's)."""
    from kvlab.experiments.cli.flags import parse_bytes
    block, _, page = size.partition("-")
    options: dict[str, int] = {}
    try:
        options["elastic_block_size"] = int(block)
        if page:
            options["elastic_page_size"] = parse_bytes(page)
    except Exception:
        options = {}
    if not (0 < options.get("elastic_block_size", 0) <= MAX_UNIT_TOKENS
            and 0 < options.get("elastic_page_size", 1) <= MAX_PAGE_BYTES):
        raise ConfigError(f"bad backend {shown(item)}: elastic-BLOCK[-SIZE] like elastic-16 or elastic-16-2MiB")
    return SimCase("elastic", budget_gb, watermark=watermark, **options)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


__all__ = ["ServeSpec", "backend_label", "format_page", "parse_backends", "plan", "run_point"]
