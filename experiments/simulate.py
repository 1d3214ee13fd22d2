"""`kvlab simulate`: the real scheduler and backends (accounting-only) on a roofline clock.

Article semantics (see docs/experiments.md, "What the seed article's simulator must have done"): every request
arrives at t=0, the batch is bounded only by KV memory (max_num_seqs = number of requests, a token budget that
admits every prefill that fits), running sequences grow before new ones are admitted, preemption is
newest-first by recompute, and the watermark applies at admission only. Reserve and oracle run without a
watermark; paged and vmm use the case's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlab.common.config import EngineConfig, load_toml, make_config
from kvlab.common.errors import ConfigError
from kvlab.experiments import cli
from kvlab.experiments.roofline import HARDWARE, RooflineCost, RooflineRunner, hardware, model_spec
from kvlab.experiments.workload import Request, WorkloadSpec, build_workload, parse_workload, scaled

POLICIES = ("reserve", "oracle", "paged", "vmm")
PROMPT_TOKEN = 5           # prompt content is irrelevant without prefix caching
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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        return d


def case_config(case: SimCase, settings: SimSettings, requests: list[Request]) -> EngineConfig:
    if case.policy not in POLICIES:
        raise ConfigError(f"unknown policy {case.policy!r}; choose one of: {', '.join(POLICIES)}")
    n = len(requests)
    longest = max(r.total_len for r in requests)
    values: dict[str, Any] = {
        "max_num_seqs": n, "max_num_batched_tokens": max(n, sum(r.total_len for r in requests)),
        "max_model_len": max(scaled(settings.workload.max_len, settings.workload.scale), longest),
        "preemption_mode": "recompute", "dtype": settings.dtype, "device": "cpu", "seed": settings.workload.seed}
    values.update(settings.engine)
    values.update(backend={"oracle": "reserve"}.get(case.policy, case.policy),
                  reserve_mode="oracle" if case.policy == "oracle" else "max",
                  kv_cache_bytes=int(case.budget_gb * 1e9), watermark=case.watermark)
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
            if item.needs_logits and seq.num_output_tokens + 1 >= seq.max_tokens:
                end = item.context_len
                self.waste.append(held_capacity(self.cache.allocator, seq, end, self.max_len) - end)
        return self.runner.execute(out)


def drive(engine: Any, runner: RooflineRunner, requests: list[Request]) -> None:
    """Add each request when the simulated clock reaches its arrival; idle time jumps to the next one."""
    from kvlab.common.sampling_params import SamplingParams
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_s <= runner.clock():
            r = pending.popleft()
            engine.add_request([PROMPT_TOKEN] * r.prompt_len,
                               SamplingParams(max_tokens=r.output_len, ignore_eos=True), arrival_time=r.arrival_s)
        if not engine.has_unfinished():
            runner.advance_to(pending[0].arrival_s)
            continue
        engine.step()


def run_case(case: SimCase, settings: SimSettings, requests: list[Request] | None = None) -> SimRow:
    from kvlab.common.engine import Engine
    from kvlab.common.kv.seam import create_cache
    requests = requests if requests is not None else build_workload(settings.workload)
    spec = model_spec(settings.model, settings.dtype)
    cost = RooflineCost(hardware(settings.hardware), spec, settings.model_prefill, settings.mfu)
    config = case_config(case, settings, requests)
    start = time.perf_counter()
    cache = create_cache(config, spec.kv_shape(), accounting_only=True)
    runner = RooflineRunner(cost, SAMPLED_TOKEN)
    probe = WasteProbe(runner, cache, config.max_model_len)
    engine = Engine(config, cache, probe, timeline_every=settings.timeline_every or 10**9)
    try:
        engine.reset_metrics()
        drive(engine, runner, requests)
        m = engine.metrics()
    finally:
        engine.close()
    return SimRow(
        policy=case.policy, budget_gb=case.budget_gb, block_size=case.block_size, page_size=case.page_size,
        watermark=case.watermark, mean_batch=m.mean_batch, utilization=m.kv_utilization,
        output_tokens_per_s=m.output_tokens_per_s, preemptions=m.preemptions, recompute_tokens=m.recomputed_tokens,
        mean_waste_tokens=sum(probe.waste) / len(probe.waste) if probe.waste else 0.0, label=case.label,
        max_batch=m.max_batch, steps=m.num_steps, output_tokens=m.output_tokens, failed_requests=m.num_failed,
        sim_seconds=m.wall_seconds, recompute_seconds=cost.prefill_seconds(m.recomputed_tokens),
        wall_seconds=time.perf_counter() - start, scheduler_seconds=m.scheduler_seconds,
        timeline=m.timeline if settings.timeline_every else {})


def _run_case_job(args: tuple[SimCase, SimSettings]) -> SimRow:
    return run_case(*args)


def run_cases(cases: list[SimCase], settings: SimSettings, jobs: int = 1, progress: bool = True) -> list[SimRow]:
    """Each distinct case once (in worker processes when jobs > 1), results in the order of `cases`."""
    unique = list({c.key: c for c in cases}.values())
    requests = build_workload(settings.workload)      # validates the workload before any worker starts
    bar = _progress(len(unique), progress)
    done: dict[tuple, SimRow] = {}
    if jobs > 1 and len(unique) > 1:
        with ProcessPoolExecutor(min(jobs, len(unique))) as pool:
            for case, row in zip(unique, pool.map(_run_case_job, [(c, settings) for c in unique])):
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
    from tqdm import tqdm
    return tqdm(total=total, desc="simulate", unit="run", leave=False)


# -- CLI ------------------------------------------------------------------------------------------------------

def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate", help="roofline simulation at GPU scale (real scheduler, accounting-only caches)",
        description="Serve a workload with the real scheduler and accounting-only caches on a roofline clock.")
    p.add_argument("--preset", choices=["seed"], help="reproduce the seed article's simulation tables")
    p.add_argument("--worked-example", action="store_true", help="the article's hand examples, by the backends")
    p.add_argument("--policies", type=cli.parse_list, default=["reserve", "oracle", "paged"],
                   help="comma list of reserve, oracle, paged, vmm")
    p.add_argument("--budget-gb", type=float, default=60.0, help="KV budget in GB (1e9 bytes)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--page-size", type=cli.parse_bytes, default=2 * 2**20)
    p.add_argument("--watermark", type=float, default=0.05, help="admission watermark (paged, vmm)")
    p.add_argument("--workload", type=cli.arg_type(parse_workload), default=parse_workload("seed"),
                   help="seed | fixed:P:O | uniform:PLO-PHI:OLO-OHI | trace:FILE.jsonl")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="with --preset seed: run seeds SEED..SEED+N-1 and report each figure's spread")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at t=0)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length (and max length)")
    p.add_argument("--max-len", type=int, default=4096, help="maximum prompt + output length")
    p.add_argument("--hardware", default="h100", help=f"one of {', '.join(HARDWARE)}")
    p.add_argument("--model", default="llama3-8b", help="llama3-8b, llama3-70b, llama2-7b, smollm2-135m, tiny, "
                                                        "or an HF config.json")
    p.add_argument("--model-prefill", action="store_true", help="charge prefill as flops / (peak x mfu)")
    p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument("--config", metavar="FILE", help="TOML with engine overrides (e.g. max_num_seqs)")
    p.add_argument("--max-num-seqs", type=int, help="cap the batch (default: unbounded, as the article)")
    p.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (default: unbounded)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes for independent runs")
    p.add_argument("--json", metavar="PATH", help='write {"rows": [...]} to PATH')
    p.add_argument("--plot", metavar="PNG", help="running batch over simulated time, one line per run")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    spec = dataclasses.replace(args.workload, num_requests=args.num_requests, seed=args.seed, rate=args.rate,
                               scale=args.scale, max_len=args.max_len)
    engine = load_toml(args.config) if args.config else {}
    engine.update({k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                     ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None})
    hardware(args.hardware)          # fail fast on bad input, before any worker starts
    model_spec(args.model)
    build_workload(spec)
    return SimSettings(workload=spec, hardware=args.hardware, model=args.model, model_prefill=args.model_prefill,
                       mfu=args.mfu, engine=engine, timeline_every=5 if args.plot else 0)


def cases_from_args(args: argparse.Namespace) -> list[SimCase]:
    cases = []
    for policy in args.policies:
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}; choose from: {', '.join(POLICIES)}")
        growing = policy in ("paged", "vmm")
        cases.append(SimCase(policy, args.budget_gb, args.block_size if policy == "paged" else None,
                             args.page_size if policy == "vmm" else None, args.watermark if growing else 0.0))
    return cases


def run(args: argparse.Namespace) -> int:
    if args.worked_example:
        from kvlab.experiments.worked_example import print_worked_example
        print_worked_example()
        if not args.preset:
            return 0
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    settings = settings_from_args(args)
    t0 = time.perf_counter()
    if args.preset == "seed" and args.seeds > 1:
        from kvlab.experiments import seed_article
        print(seed_article.spread(settings, args.seeds, args.jobs, not args.no_progress))
        print(f"\n{time.perf_counter() - t0:.1f} s host time")
        return 0
    if args.preset == "seed":
        from kvlab.experiments import seed_article
        cases = seed_article.cases()
        rows = run_cases(cases, settings, args.jobs, not args.no_progress)
        print(seed_article.report(cases, rows, settings))
        plotted = list({c.key: r for c, r in zip(cases, rows) if c.key in seed_article.PLOTTED}.values())
    else:
        cases = cases_from_args(args)
        rows = plotted = run_cases(cases, settings, args.jobs, not args.no_progress)
        print(plain_report(rows, settings))
    print(f"\n{len({c.key for c in cases})} simulations in {time.perf_counter() - t0:.1f} s host time "
          f"(longest {max(r.wall_seconds for r in rows):.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.to_json() for r in rows]}, indent=1))
        print(f"rows written to {args.json}")
    if args.plot:
        plot_batches(args.plot, plotted)
        print(f"plot written to {args.plot}")
    return 0


def plain_report(rows: list[SimRow], settings: SimSettings) -> str:
    from kvlab.experiments.report import fmt, pct, table
    title = (f"{settings.workload.num_requests} requests ({settings.workload.kind}), {settings.model} on "
             f"{settings.hardware}, prefill {'modelled' if settings.model_prefill else 'ignored'}")
    body = [[r.label, f"{r.budget_gb:g}", pct(r.watermark, 0), fmt(r.mean_batch), pct(r.utilization),
             fmt(r.output_tokens_per_s), r.preemptions, fmt(r.mean_waste_tokens), f"{r.sim_seconds:.3g}"]
            for r in rows]
    headers = ["policy", "GB", "wm", "mean batch", "util", "tok/s", "preempt", "end waste", "sim s"]
    return table(headers, body, title)


def plot_batches(path: str, rows: list[SimRow]) -> None:
    from kvlab.experiments.plots import Series, downsample, line_chart
    series = [downsample(Series(f"{r.label} {fmt_gb(r.budget_gb)} wm {r.watermark:g}", r.timeline["time"],
                                r.timeline["running"])) for r in rows if r.timeline]
    line_chart(path, series, "simulated seconds", "running sequences", "Running batch over time (roofline clock)")


def fmt_gb(gb: float) -> str:
    return f"{gb:g} GB"
