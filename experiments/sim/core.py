"""The simulation core behind `kvlab simulate`: the real scheduler and backends (accounting-only) on a roofline
clock. The command line lives in experiments/sim/cli.py; the article's tables in experiments/sim/seed_article.py.

Article semantics (see docs/experiments.md, "What the seed article's simulator must have done"): every request
arrives at t=0, the batch is bounded only by KV memory (max_num_seqs = number of requests, a token budget that
admits every prefill that fits), running sequences grow before new ones are admitted, preemption is
newest-first by recompute, and the watermark applies at admission only. Reserve and oracle run without a
watermark; paged and vmm use the case's.
"""
from __future__ import annotations

import multiprocessing
import signal
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from kvlab.common.config import EngineConfig, make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import backend_names
from kvlab.experiments.sim.roofline import RooflineCost, RooflineRunner, hardware, model_spec
from kvlab.experiments.workloads.requests import Request, WorkloadSpec, build_workload, scaled

ALIASES = {"oracle": ("reserve", {"reserve_mode": "oracle"})}   # policy -> (backend, its options)


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


@dataclass(slots=True)
class SimCase:
    policy: str                       # reserve | oracle | paged | vmm
    budget_gb: float
    block_size: int | None = None     # tokens (paged)
    page_size: int | None = None      # bytes (vmm)
    watermark: float = 0.0

    @property
    def label(self) -> str:
        if self.policy == "paged":
            return f"paged-{self.block_size}"
        if self.policy == "vmm":
            return f"vmm-{format_page(self.page_size)}"
        return "reserve-max" if self.policy == "reserve" else "oracle"

    @property
    def key(self) -> tuple:
        return (self.policy, self.budget_gb, self.block_size, self.page_size, self.watermark)


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


@dataclass(slots=True)
class SimRow:
    policy: str
    budget_gb: float
    block_size: int | None
    page_size: int | None
    watermark: float
    mean_batch: float
    utilization: float
    output_tokens_per_s: float
    preemptions: int
    recompute_tokens: int
    mean_waste_tokens: float
    label: str = ""
    max_batch: int = 0
    steps: int = 0
    output_tokens: int = 0
    failed_requests: int = 0
    sim_seconds: float = 0.0
    recompute_seconds: float = 0.0       # the recompute tokens as prefill at the mfu (article: 50%)
    wall_seconds: float = 0.0            # host time of this simulation
    scheduler_seconds: float = 0.0       # host time in schedule() + update()
    timeline: dict[str, list] = field(default_factory=dict)
    tensor_parallel_size: int = 1        # budget_gb is per GPU; the cluster holds tp x budget_gb
    allreduce_seconds: float = 0.0       # simulated time in all-reduces (part of sim_seconds)

    def to_json(self) -> dict[str, Any]:
        """At tp=1 the keys of the seed article's rows, unchanged (no TP keys)."""
        d = asdict(self)
        d.pop("timeline")
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
    if case.block_size is not None:
        values["block_size"] = case.block_size
    if case.page_size is not None:
        values["page_size"] = case.page_size
    return make_config(**values)


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
    comm_seconds: float = 0.0     # simulated all-reduce time (tp > 1)


def simulate(case: SimCase, settings: SimSettings, requests: list[Request], tap: Any = None) -> SimRun:
    """One simulation. `tap`, when given, wraps the roofline runner (`tap.attach(runner, cache)`: the serving
    simulator's token clock and driver costs), is bound to the engine (`tap.bind(engine)`), and gets `tap.added`
    and `tap.finished` = drive's (request id, request) pairs and RequestMetrics by request id."""
    from kvlab.common.engine import Engine
    from kvlab.common.kv.seam import create_cache
    spec = model_spec(settings.model, settings.dtype, settings.engine.get("kv_cache_dtype", "auto"),
                      settings.tensor_parallel_size)
    cost = RooflineCost(hardware(settings.hardware), spec, settings.model_prefill, settings.mfu)
    config = case_config(case, settings, requests)
    start = time.perf_counter()
    # tp > 1: the one cache the scheduler sees is one rank's (its KV heads, the per-GPU budget); every rank's
    # tables are identical (common/dist/), so its capacity in tokens is the cluster's
    cache = create_cache(config, spec.kv_shape(), accounting_only=True)
    runner = RooflineRunner(cost, SAMPLED_TOKEN)
    inner = tap.attach(runner, cache) if tap is not None else runner
    probe = WasteProbe(inner, cache, config.max_model_len)
    engine = Engine(config, cache, probe, timeline_every=settings.timeline_every or 10**9)
    if tap is not None:
        tap.bind(engine)
    try:
        engine.reset_metrics()
        added, finished = drive(engine, runner, requests, settings.max_concurrency)
        m, stats = engine.metrics(), engine.cache_stats()
        if tap is not None:
            tap.added, tap.finished = added, finished
    finally:
        engine.close()
    return SimRun(m, stats, probe.waste, cost, time.perf_counter() - start, runner.comm_seconds)


def run_case(case: SimCase, settings: SimSettings, requests: list[Request] | None = None,
             tap: Any = None) -> SimRow:
    requests = requests if requests is not None else build_workload(settings.workload)
    run = simulate(case, settings, requests, tap)
    m, waste = run.metrics, run.waste
    return SimRow(
        policy=case.policy, budget_gb=case.budget_gb, block_size=case.block_size, page_size=case.page_size,
        watermark=case.watermark, mean_batch=m.mean_batch, utilization=m.kv_utilization,
        output_tokens_per_s=m.output_tokens_per_s, preemptions=m.preemptions, recompute_tokens=m.recomputed_tokens,
        mean_waste_tokens=sum(waste) / len(waste) if waste else 0.0, label=case.label,
        max_batch=m.max_batch, steps=m.num_steps, output_tokens=m.output_tokens, failed_requests=m.num_failed,
        sim_seconds=m.wall_seconds, recompute_seconds=run.cost.prefill_seconds(m.recomputed_tokens),
        wall_seconds=run.wall_seconds, scheduler_seconds=m.scheduler_seconds,
        timeline=m.timeline if settings.timeline_every else {},
        tensor_parallel_size=settings.tensor_parallel_size, allreduce_seconds=run.comm_seconds)


def _run_case_job(args: tuple[SimCase, SimSettings]) -> SimRow:
    return run_case(*args)


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


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which terminates them (no KeyboardInterrupt trace per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def worker_pool(processes: int) -> Iterator[Any]:
    """A process pool whose workers are terminated, not awaited, when the parent is interrupted or fails: a
    Ctrl-C stops every worker at once and leaves no orphan behind."""
    pool = multiprocessing.get_context().Pool(processes, initializer=_ignore_sigint)
    try:
        yield pool
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from kvlab.experiments.reporting.tables import progress_bar
    return progress_bar(total=total, desc="simulate", unit="run", leave=False)


# -- CLI ------------------------------------------------------------------------------------------------------

