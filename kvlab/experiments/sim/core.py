"""The simulation core behind `kvlab simulate`: the real scheduler and backends (accounting-only) on a roofline
clock. The command line lives in experiments/sim/cli.py; the article's tables in experiments/sim/seed_article.py.

Article semantics (see docs/experiments.md, "What the seed article's simulator must have done"): every request
arrives at t=0, the batch is bounded only by KV memory (max_num_seqs = number of requests, a token budget that
admits every prefill that fits), running sequences grow before new ones are admitted, preemption is
newest-first by recompute, and the watermark applies at admission only. Reserve and oracle run without a
watermark; paged and vmm use the case's.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from kvlab.common.config import EngineConfig, make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import backend_names, get_backend
from kvlab.common.metrics import RunMetrics
from kvlab.experiments.sim.collector import collector_paused
from kvlab.experiments.sim.kernels import KernelTerm, kernel_profile
from kvlab.experiments.sim.layouts import (
    CROSS_LAYER,
    LAYOUT_OPTION,
    LayoutRunner,
    check_layout,
    check_penalty,
    emulated_page,
    layers_per_page,
)
from kvlab.experiments.sim.roofline import RooflineCost, RooflineRunner, hardware, model_spec
from kvlab.experiments.sim.workers import worker_pool
from kvlab.experiments.workloads.requests import Request, WorkloadSpec, build_workload, scaled

ALIASES = {"oracle": ("reserve", {"reserve_mode": "oracle"})}   # policy -> (backend, its options)
ARTICLE_LABELS = {"reserve": "reserve-max"}     # a spec's label -> the seed article's name for that run


def policies() -> tuple[str, ...]:
    """Every registered backend, plus the aliases that are a backend with fixed options."""
    return (*backend_names(), *ALIASES)


def policy_backend(policy: str) -> str:
    if policy in ALIASES:
        return ALIASES[policy][0]
    if policy not in backend_names():
        raise ConfigError(f"unknown policy {policy!r}; choose one of: {', '.join(policies())}")
    return policy


PROMPT_TOKEN = 5           # the prompt of a request without token_ids (content matters to prefix caching only)
SAMPLED_TOKEN = 0


@dataclass(slots=True, init=False)
class SimCase:
    """One simulated run's backend (a registered one, or an alias of one with fixed options: oracle), its options
    as flat keys (block_size=16, page_size=2MiB, ...), its KV budget and admission watermark."""
    policy: str
    budget_gb: float
    watermark: float
    options: dict[str, Any]

    def __init__(self, policy: str, budget_gb: float, block_size: int | None = None, page_size: int | None = None,
                 watermark: float = 0.0, **options: Any) -> None:
        # block_size and page_size keep their positions for the callers written before `options`: both are flat
        # options, like any in **options
        given = {"block_size": block_size, "page_size": page_size, **options}
        self.policy, self.budget_gb, self.watermark = policy, budget_gb, watermark
        self.options = {k: v for k, v in given.items() if v is not None}

    @property
    def backend(self) -> str:
        return policy_backend(self.policy)

    @property
    def layout(self) -> str:
        """vmm's KV layout (experiments/sim/layouts.py): per-layer unless the case says cross-layer."""
        return self.options.get(LAYOUT_OPTION, "per-layer")

    def backend_options(self) -> Any:
        """Its backend's options dataclass: the alias's fixed options, then the case's own (less the simulator's
        own option, the vmm layout)."""
        spec = get_backend(self.backend)
        values = {**ALIASES.get(self.policy, (spec.name, {}))[1], **backend_values(self.options)}
        unknown = sorted(set(values) - set(declared_options(self.policy, values)))
        if unknown:
            raise ConfigError(f"backend {spec.name!r} has no option {', '.join(unknown)} (policy {self.policy!r})")
        return spec.options(**values)

    @property
    def backend_label(self) -> str:
        """The registered spec's label for these options (paged-16, vmm-2MiB, oracle; vmm-2MiB-crosslayer)."""
        label = get_backend(self.backend).label(self.backend_options())
        return f"{label}-crosslayer" if self.layout == CROSS_LAYER else label

    @property
    def label(self) -> str:
        """The backend label in the seed article's words, where they differ."""
        return ARTICLE_LABELS.get(self.backend_label, self.backend_label)

    @property
    def key(self) -> tuple:
        return case_key(self.policy, self.budget_gb, self.options, self.watermark)


def declared_options(policy: str, values: dict[str, Any]) -> dict[str, Any]:
    """Those of `values` (flat options, e.g. from the command line) that the policy's backend declares (vmm: and
    the simulator's layout option)."""
    declared = {f.name for f in fields(get_backend(policy_backend(policy)).options)}
    if policy_backend(policy) == "vmm":
        declared.add(LAYOUT_OPTION)
    return {k: v for k, v in values.items() if k in declared}


def backend_values(options: dict[str, Any]) -> dict[str, Any]:
    """A case's options less the simulator's own (the vmm layout): what the backend itself is given."""
    if LAYOUT_OPTION in options:
        check_layout(options[LAYOUT_OPTION])
    return {k: v for k, v in options.items() if k != LAYOUT_OPTION}


def case_key(policy: str, budget_gb: float, options: dict[str, Any], watermark: float) -> tuple:
    """What tells two runs apart: the same for a case and its row."""
    return (policy, budget_gb, tuple(sorted(options.items())), watermark)


def format_page(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes // 2**20}MiB" if nbytes % 2**20 == 0 else f"{nbytes // 1024}KiB"


@dataclass(slots=True)
class SimSettings:
    """Everything a case needs besides its own knobs (picklable: cases run in worker processes)."""
    workload: WorkloadSpec
    hardware: str = "h100"
    model: str = "llama3-8b"
    dtype: str = "bfloat16"
    model_prefill: bool = False
    mfu: float = 0.5
    engine: dict[str, Any] = field(default_factory=dict)   # EngineConfig overrides (max_num_seqs, ...)
    timeline_every: int = 0                                 # 0 = no timeline kept
    tensor_parallel_size: int = 1     # >1: the cache and the costs are one rank's shard; budgets are per GPU
    max_concurrency: int = 0          # serving: at most this many requests in flight at the client (0 = no limit)
    kernel_costs: str = "none"        # the kernel term's profile: none | published | cpu | measured:FILE (kernels.py)
    layout_penalty: str = "none"      # a cross-layer vmm case's attention penalty: none | kvcached (layouts.py)


# The row keys of the releases before the shared run record, kept one more release: old name -> canonical name
# (docs/run-record.md). `block_size` and `page_size` are printed on every row too, None where not an option.
OLD_KEYS = {"utilization": "kv_utilization", "steps": "num_steps", "recompute_tokens": "recomputed_tokens",
            "failed_requests": "num_failed"}
OLD_OPTION_KEYS = ("block_size", "page_size")
# The row's figures on the host clock: they vary from run to run of the same case
HOST_TIMED = ("wall_seconds", "scheduler_seconds", "allocator_seconds", "allocator_share")


@dataclass(slots=True)
class SimRow(RunMetrics):
    """One simulated run: the run record (common/metrics.py: the names bench and /metrics use), the case, and
    the simulator's own figures. `wall_seconds` is the host time the simulation took; the engine's clock is the
    roofline's, and the run's length on it is `sim_seconds`."""
    policy: str = ""
    budget_gb: float = 0.0
    watermark: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    mean_waste_tokens: float = 0.0       # allocated-but-empty slots before a sequence's last step, mean
    sim_seconds: float = 0.0
    recompute_seconds: float = 0.0       # the recomputed tokens as prefill at the mfu (article: 50%)
    tensor_parallel_size: int = 1        # budget_gb is per GPU; the cluster holds tp x budget_gb
    allreduce_seconds: float = 0.0       # simulated time in all-reduces (part of sim_seconds)
    kernel_costs: str = "none"           # the kernel term's profile
    busy_seconds: float = 0.0            # summed step time (sim_seconds less idle waits for arrivals)
    attention_seconds: float = 0.0       # of it, attention (with kernel_costs none: the roofline's K/V reads)
    driver_step_seconds: float = 0.0     # of it, driver calls that lengthened steps (simulate serve's costs)
    attention_share: float = 0.0         # the three shares of busy_seconds
    driver_share: float = 0.0
    other_share: float = 0.0             # weights, prefill compute, all-reduces

    @property
    def key(self) -> tuple:
        return case_key(self.policy, self.budget_gb, self.options, self.watermark)

    def __getattr__(self, name: str) -> Any:
        """The old attribute names (OLD_KEYS) for one release; called only when no field matches."""
        if name in OLD_KEYS:
            return getattr(self, OLD_KEYS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_json(self) -> dict[str, Any]:
        """The record without its timeline, the old keys beside the new; at tp=1 no TP keys."""
        d = self.to_dict()
        d.update({old: d[new] for old, new in OLD_KEYS.items()})
        d.update({key: self.options.get(key) for key in OLD_OPTION_KEYS})
        if self.tensor_parallel_size == 1:
            d.pop("tensor_parallel_size")
            d.pop("allreduce_seconds")
        return d


def case_config(case: SimCase, settings: SimSettings, requests: list[Request]) -> EngineConfig:
    backend = policy_backend(case.policy)
    n = len(requests)
    longest = max(r.total_len for r in requests)
    values: dict[str, Any] = {
        "max_num_seqs": n, "max_num_batched_tokens": max(n, sum(r.total_len for r in requests)),
        "max_model_len": max(scaled(settings.workload.max_len, settings.workload.scale), longest),
        "preemption_mode": "recompute", "dtype": settings.dtype, "device": "cpu", "seed": settings.workload.seed}
    values.update(settings.engine)
    values.update(backend=backend, kv_cache_bytes=int(case.budget_gb * 1e9), watermark=case.watermark)
    values.update(ALIASES.get(case.policy, (backend, {}))[1])
    values.update(backend_values(case.options))
    if case.layout == CROSS_LAYER:
        values["page_size"] = emulated_page(case.options["page_size"], sim_model(settings))
    return make_config(**values)


def sim_model(settings: SimSettings) -> Any:
    return model_spec(settings.model, settings.dtype, settings.engine.get("kv_cache_dtype", "auto"),
                      settings.tensor_parallel_size)


def make_runner(cost: RooflineCost, case: SimCase, settings: SimSettings, cache: Any) -> RooflineRunner:
    """The case's roofline runner: its kernel term, and a cross-layer case's attention penalty when asked."""
    kernel = kernel_term(settings.kernel_costs, cache)
    penalty = check_penalty(settings.layout_penalty) if case.layout == CROSS_LAYER else 0.0
    if penalty:
        return LayoutRunner(cost, SAMPLED_TOKEN, kernel, penalty=penalty)
    return RooflineRunner(cost, SAMPLED_TOKEN, kernel)


def held_capacity(cache: Any, seq: Any, low: int, high: int) -> int:
    """Tokens `seq` can hold without more units, by the backend's own units_needed (binary search)."""
    if cache.units_needed(seq, low):
        return low
    while low < high:
        mid = (low + high + 1) // 2
        if cache.units_needed(seq, mid) == 0:
            low = mid
        else:
            high = mid - 1
    return low


class WasteProbe:
    """Runner wrapper: before a sequence's last step, records its allocated-but-empty slots."""

    def __init__(self, runner: RooflineRunner, cache: Any, max_len: int) -> None:
        self.runner, self.cache, self.max_len = runner, cache, max_len
        self.waste: list[int] = []

    def clock(self) -> float:
        return self.runner.clock()

    def execute(self, out: Any) -> dict[int, int]:
        for item in out.items:
            seq = item.seq
            if item.needs_logits and len(seq.token_ids) - seq.prompt_len + 1 >= seq.max_tokens:
                end = item.context_len
                self.waste.append(held_capacity(self.cache.allocator, seq, end, self.max_len) - end)
        return self.runner.execute(out)


def drive(engine: Any, runner: RooflineRunner, requests: list[Request],
          max_concurrency: int = 0) -> tuple[list[tuple[str, Request]], dict[str, Any]]:
    """Add each request when the simulated clock reaches its arrival; idle time jumps to the next one. With
    `max_concurrency` N > 0, at most N requests are in flight (the client's limit, as `vllm bench serve`'s): an
    arrival that finds N in flight is sent when one finishes, and the engine sees it then (its send time).
    Returns (request id, request) in the order added, and each request's RequestMetrics by request id."""
    from kvlab.common.sampling_params import SamplingParams
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    free_since = deque([0.0] * (max_concurrency or len(requests)))     # when each free client slot freed up
    added, finished = [], {}
    while pending or engine.has_unfinished():
        while pending and free_since and pending[0].arrival_s <= runner.clock():
            r = pending.popleft()
            prompt = r.token_ids if r.token_ids is not None else [PROMPT_TOKEN] * r.prompt_len
            added.append((engine.add_request(prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                             arrival_time=max(r.arrival_s, free_since.popleft())), r))
        if not engine.has_unfinished():
            runner.advance_to(pending[0].arrival_s)
            continue
        for out in engine.step().finished:
            finished[out.request_id] = out.metrics
            free_since.append(runner.clock())
    return added, finished


@dataclass(slots=True)
class SimRun:
    """One simulated case as the engine saw it: its metrics, the cache's last stats, and what the probe saw."""
    metrics: Any
    cache_stats: Any
    waste: list[int]
    cost: RooflineCost
    wall_seconds: float
    runner: RooflineRunner        # its counters: comm, step, attention and driver seconds


def simulate(case: SimCase, settings: SimSettings, requests: list[Request], tap: Any = None) -> SimRun:
    """One simulation. `tap`, when given, wraps the roofline runner (`tap.attach(runner, cache, layers_per_page)`:
    the serving
    simulator's token clock and driver costs), is bound to the engine (`tap.bind(engine)`), and gets `tap.added`
    and `tap.finished` = drive's (request id, request) pairs and RequestMetrics by request id."""
    from kvlab.common.engine import Engine
    from kvlab.common.kv.seam import create_cache
    spec = sim_model(settings)
    cost = RooflineCost(hardware(settings.hardware), spec, settings.model_prefill, settings.mfu)
    config = case_config(case, settings, requests)
    start = time.perf_counter()
    # tp > 1: the one cache the scheduler sees is one rank's (its KV heads, the per-GPU budget); every rank's
    # tables are identical (common/dist/), so its capacity in tokens is the cluster's
    cache = create_cache(config, spec.kv_shape(), accounting_only=True)
    runner = make_runner(cost, case, settings, cache)
    inner = tap.attach(runner, cache, layers_per_page(case.options, spec)) if tap is not None else runner
    probe = WasteProbe(inner, cache, config.max_model_len)
    engine = Engine(config, cache, probe, timeline_every=settings.timeline_every or 10**9, stream_tokens=False)
    if tap is not None:
        tap.bind(engine)
    try:
        engine.reset_metrics()
        with collector_paused():
            added, finished = drive(engine, runner, requests, settings.max_concurrency)
        m, stats = engine.metrics(), engine.cache_stats()
        if tap is not None:
            tap.added, tap.finished = added, finished
    finally:
        engine.close()
    return SimRun(m, stats, probe.waste, cost, time.perf_counter() - start, runner)


def kernel_term(kernel_costs: str, cache: Any) -> KernelTerm | None:
    """The case's kernel term: its backend's layout, and a paged layout's block size, under the profile."""
    profile = kernel_profile(kernel_costs)
    if profile is None:
        return None
    allocator = cache.allocator
    layout = get_backend(allocator.name).layout
    return KernelTerm(profile, layout, allocator.tokens_per_unit if layout == "paged" else 0)


def step_shares(runner: RooflineRunner) -> dict[str, float]:
    """Where the step time went: attention, driver calls, and everything else (seconds and shares)."""
    busy = runner.step_seconds + runner.driver_seconds
    attention, driver = runner.attention_seconds, runner.driver_seconds
    shares = {"attention_share": attention / busy, "driver_share": driver / busy,
              "other_share": (busy - attention - driver) / busy} if busy else {}
    return {"busy_seconds": busy, "attention_seconds": attention, "driver_step_seconds": driver, **shares}


def run_case(case: SimCase, settings: SimSettings, requests: list[Request] | None = None,
             tap: Any = None) -> SimRow:
    requests = requests if requests is not None else build_workload(settings.workload)
    run = simulate(case, settings, requests, tap)
    m, waste = run.metrics, run.waste
    record = {f.name: getattr(m, f.name) for f in fields(m)}
    record.update(wall_seconds=run.wall_seconds, timeline=m.timeline if settings.timeline_every else {})
    return SimRow(
        **record, policy=case.policy, budget_gb=case.budget_gb, watermark=case.watermark, options=case.options,
        label=case.label, mean_waste_tokens=sum(waste) / len(waste) if waste else 0.0, sim_seconds=m.wall_seconds,
        recompute_seconds=run.cost.prefill_seconds(m.recomputed_tokens),
        tensor_parallel_size=settings.tensor_parallel_size, allreduce_seconds=run.runner.comm_seconds,
        kernel_costs=settings.kernel_costs, **step_shares(run.runner))


def _run_case_job(job: tuple[SimCase, SimSettings]) -> SimRow:
    return run_case(*job)


def run_cases(cases: list[SimCase], settings: SimSettings, jobs: int = 1, progress: bool = True) -> list[SimRow]:
    """Each distinct case once (in worker processes when jobs > 1), results in the order of `cases`."""
    unique = list({c.key: c for c in cases}.values())
    requests = build_workload(settings.workload)      # validates the workload before any worker starts
    bar = _progress(len(unique), progress)
    done: dict[tuple, SimRow] = {}
    if jobs > 1 and len(unique) > 1:
        with worker_pool(min(jobs, len(unique))) as pool:
            for case, row in zip(unique, pool.imap(_run_case_job, [(c, settings) for c in unique])):
                done[case.key] = row
                bar and bar.update(1)
    else:
        for case in unique:
            done[case.key] = run_case(case, settings, requests)
            bar and bar.update(1)
    if bar:
        bar.close()
    return [done[c.key] for c in cases]


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from kvlab.experiments.reporting.tables import progress_bar
    return progress_bar(total=total, desc="simulate", unit="run", leave=False)

