"""`kvlab simulate serve`: the flags, the run (grid of rates, or an SLO search per backend and seed), the
tables, and JSON/CSV/plots in results/<timestamp>/."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.common import limits, machine
from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN, check_seed
from kvlab.common.validate import check_int, check_number
from kvlab.experiments.cli import flags
from kvlab.experiments.limits import MAX_BUDGET_GB, MAX_REQUESTS, MAX_SPAN_S
from kvlab.experiments.loadgen import latency
from kvlab.experiments.loadgen.rows import ROW_KEYS, parse_rates
from kvlab.experiments.reporting.checkpoint import keeping
from kvlab.experiments.reporting.verdict import short_run_warning
from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.kernels import CHOICES, kernel_profile
from kvlab.experiments.sim.layouts import CROSS_LAYER, add_layout_flags, check_layout, emulated_page
from kvlab.experiments.sim.roofline import HARDWARE, hardware, model_spec
from kvlab.experiments.sim.serve import search_pool, slo, summary
from kvlab.experiments.sim.serve.costs import PROFILES, SET_ACCESS, known_profile, profile
from kvlab.experiments.sim.serve.grid import Saved, pool_map, saved_points
from kvlab.experiments.sim.serve.run import (
    SHARE_KEYS,
    ServeSpec,
    backend_label,
    parse_backends,
    plan,
    run_point,
)
from kvlab.experiments.sim.serve.tables import grid_table, slo_table

# Where a search starts. On the rate axis above most knees: a run past the knee stops as soon as its SLO is
# certainly missed (early_stop.py), one below it runs to its end, so bracketing down costs fewer simulated steps
# than bracketing up (and the same bisection follows once the knee is bracketed)
RATE_START = 64.0
CONCURRENCY_START = 4
STEADY_REQUESTS = 1000           # fewer: the start and the drain weigh on the rates (reporting/verdict.py)
PAGED_BYTES_PER_BLOCK = 160      # blocks keep ~160 B of books each (as `kvlab simulate`)
SLO_KEYS = {f"{stat}_{metric}_ms" for metric in latency.METRICS
            for stat in ("mean", "median", "std", *(f"p{p:g}" for p in latency.DEFAULT_PERCENTILES))}
CSV_KEYS = (*ROW_KEYS[:1], "seed", *ROW_KEYS[1:], "driver_exposed_seconds", "driver_hidden_seconds",
            "paged_overhead_seconds", *SHARE_KEYS)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="online serving on the roofline clock: rates, seeds, SLO search",
                              description="Online arrivals against the real scheduler and accounting-only "
                                          "backends on the roofline clock; `kvlab bench serve`'s result keys.")
    p.add_argument("--backends", type=flags.parse_list, default=["reserve", "paged-16", "vmm-2MiB", "vmm-64KiB"],
                   help="comma list: reserve, oracle, paged-BLOCK, vmm-SIZE, elastic-BLOCK[-SIZE]")
    p.add_argument("--request-rates", type=flags.parse_list, default=["inf"], help="comma list of req/s (inf allowed)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--dataset", default="seed", help="seed | random | trace:FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--scale", type=float, default=1.0, help="seed dataset: multiply every length")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--input-len", type=int, default=1024, help="random dataset")
    p.add_argument("--output-len", type=int, default=128, help="random dataset")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=1, help="seeds SEED..SEED+K-1, identical arrivals for every backend")
    p.add_argument("--budget-gb", type=float, default=60.0, help="KV budget in GB (1e9 bytes)")
    p.add_argument("--watermark", type=float, default=0.05, help="admission watermark (paged, vmm)")
    p.add_argument("--hardware", default="h100", help=f"one of {', '.join(HARDWARE)}")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--ignore-prefill", action="store_true", help="prefill costs nothing (the seed article)")
    p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, help="cap the batch (default: unbounded)")
    p.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (default: unbounded)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--slo", type=flags.arg_type(slo.parse_slo), help="search the highest rate meeting e.g. "
                                                                    "p99_ttft_ms<=2000,p99_tpot_ms<=100")
    p.add_argument("--search", choices=("request-rate", "max-concurrency"), default="request-rate",
                   help="the SLO search's axis: the request rate, or the client's max concurrency (integer, at "
                        "the one rate of --request-rates, default inf)")
    p.add_argument("--slo-start", type=float, help=f"first rate (default {RATE_START:g} req/s) or concurrency "
                                                    f"(default {CONCURRENCY_START}) the search tries")
    p.add_argument("--slo-tolerance", type=float, default=0.02, help="relative width at which bisection stops")
    p.add_argument("--independent-seeds", action="store_true",
                   help="rate search: every seed brackets from --slo-start (default: later seeds start at the "
                        "first seed's answer)")
    p.add_argument("--no-early-stop", action="store_true",
                   help="SLO search: run every point to the end (default: stop a run once its SLO is certainly "
                        "missed; its figures are then not reported)")
    p.add_argument("--driver-costs", default="zero", help=f"{' | '.join([*PROFILES, 'host', 'measured:FILE'])}")
    p.add_argument("--calibration", help="host profile: `kvlab calibrate`'s JSON")
    add_driver_axes(p)
    p.add_argument("--kernel-costs", default="none", metavar="PROFILE",
                   help=f"attention kernel speed by KV layout: {CHOICES} (docs/kernel-costs.md)")
    p.add_argument("--max-concurrency", type=int, default=0,
                   help="at most N requests in flight at the client (vllm bench serve's flag; 0 = no limit): an "
                        "arrival finding N in flight is sent when one finishes, and is timed from its send")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N GPUs: per-rank costs and KV, ring all-reduces over the hardware's "
                        "NVLink; --budget-gb is per GPU (docs/tensor-parallel.md, Simulator)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>/); every finished "
                                                "point is kept there as it finishes (points.jsonl)")
    p.add_argument("--resume", metavar="DIR", help="finish the interrupted run in DIR: its command line again, "
                                                   "only the points it does not hold yet")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def add_driver_axes(p: Any) -> None:
    """The vmm driver and layout axes (docs/simulator-serving.md): overlap, set-access granularity, layout."""
    p.add_argument("--background-mapping", action=argparse.BooleanOptionalAction, default=True,
                   help="vmm maps ahead on a worker thread and reclaims lazily, hiding driver calls behind the "
                        "step's compute, as vAttention's step_async (default on; --no-background-mapping: the "
                        "no-overlap variant)")
    p.add_argument("--set-access", choices=SET_ACCESS, default=SET_ACCESS[0],
                   help="cuMemSetAccess once per page mapped (vAttention's code; default) or once per mapped run")
    add_layout_flags(p, "each vmm-SIZE")


@dataclass(frozen=True)
class ServeSettings:
    """What `kvlab simulate serve` was asked for, built once from its flags (settings_from)."""
    spec: ServeSpec
    backends: tuple[str, ...]
    vmm_layouts: tuple[str, ...]
    budget_gb: float
    watermark: float
    seeds: tuple[int, ...]
    request_rates: tuple[str, ...]
    slo: dict[str, float] | None = None     # None: the grid of rates; else the search's target
    search: str = "request-rate"            # the SLO search's axis: request-rate | max-concurrency
    slo_start: float | None = None          # None: RATE_START or CONCURRENCY_START, by the axis
    slo_tolerance: float = 0.02
    independent_seeds: bool = False
    early_stop: bool = True
    jobs: int = 2
    progress: bool = True
    out: str | None = None
    save: bool = True
    plots: bool = True
    resume: str | None = None               # the results directory of an interrupted run to finish
    argv: tuple[str, ...] = ()              # the command line, stored for --resume

    def cases(self) -> list[SimCase]:
        return parse_backends(list(self.backends), self.budget_gb, self.watermark, self.vmm_layouts)


def settings_from(args: argparse.Namespace) -> ServeSettings:
    """The one place `kvlab simulate serve`'s flags are read; checked before anything is built."""
    check_flags(args)
    kernel_profile(args.kernel_costs)
    engine = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None}
    spec = ServeSpec(dataset=args.dataset, num_requests=args.num_prompts, scale=args.scale, max_len=args.max_len,
                     input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                     burstiness=args.burstiness, hardware=args.hardware, model=args.model,
                     model_prefill=not args.ignore_prefill, mfu=args.mfu, engine=engine,
                     goodput=checked_goodput(args.goodput), driver_profile=args.driver_costs,
                     calibration=args.calibration, background_mapping=args.background_mapping,
                     set_access=args.set_access, layout_penalty=args.layout_penalty, kernel_costs=args.kernel_costs,
                     tensor_parallel_size=args.tensor_parallel_size, max_concurrency=args.max_concurrency)
    settings = ServeSettings(spec, tuple(args.backends), tuple(args.vmm_layout), args.budget_gb, args.watermark,
                             tuple(range(args.seed, args.seed + args.seeds)), tuple(args.request_rates), args.slo,
                             args.search, args.slo_start, args.slo_tolerance, args.independent_seeds,
                             not args.no_early_stop, args.jobs, not args.no_progress, args.resume or args.out,
                             not args.no_save, not args.no_plots, args.resume, tuple(getattr(args, "command_line", ())))
    check_cases(settings, settings.cases())
    plan(spec, 1.0, args.seed)          # the dataset: an unknown kind or a bad trace fails here, not in a worker
    return settings


def check_flags(args: argparse.Namespace) -> None:
    """Every number in range and the output directory writable, before a worker starts or a line is printed."""
    hardware(args.hardware)
    check_int("--tensor-parallel-size", args.tensor_parallel_size, 1, 1024)
    model_spec(args.model, tp=args.tensor_parallel_size)
    if not known_profile(args.driver_costs):
        raise ConfigError(f"unknown --driver-costs {args.driver_costs!r}; choose "
                          f"{', '.join([*PROFILES, 'host', 'measured:FILE'])}")
    for layout in args.vmm_layout:
        check_layout(layout)
    check_workload_flags(args)
    check_run_flags(args)
    if args.out is not None and not args.no_save:
        flags.check_output_path(args.out, "--out", directory=True)


def check_workload_flags(args: argparse.Namespace) -> None:
    num = check_int("--num-prompts", args.num_prompts, 1, MAX_REQUESTS)
    for flag in ("--max-len", "--input-len", "--output-len"):
        check_int(flag, getattr(args, flag[2:].replace("-", "_")), 1, MAX_MODEL_LEN, " (tokens per sequence)")
    check_number("--scale", args.scale, strict=True, high=1e6)
    check_number("--range-ratio", args.range_ratio, high=0.999)
    check_number("--burstiness", args.burstiness, low=1e-3, high=1e3)
    rates = parse_rates(list(args.request_rates))
    slowest = min(rates)
    if num / slowest > MAX_SPAN_S:
        raise ConfigError(f"--request-rates {slowest:g}/s spreads {num:,} requests over ~{num / slowest:.3g} s, "
                          f"more than the maximum {MAX_SPAN_S:g} s (a week)")
    check_int("--max-concurrency", args.max_concurrency, 0, MAX_REQUESTS)
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens",
                                                               args.max_num_batched_tokens)):
        if value is not None:
            check_int(flag, value, 1, MAX_MODEL_LEN)


def check_run_flags(args: argparse.Namespace) -> None:
    seed = check_seed("--seed", args.seed)
    check_int("--seeds", args.seeds, 1, min(1000, limits.MAX_SEED - seed + 1))
    check_number("--budget-gb", args.budget_gb, strict=True, high=MAX_BUDGET_GB)
    check_number("--watermark", args.watermark, high=0.999)
    check_number("--mfu", args.mfu, strict=True, high=1.0)
    check_int("--jobs", args.jobs, 1, machine.max_threads(), " (at most 4 per CPU)")
    if args.slo_start is not None:
        check_number("--slo-start", args.slo_start, strict=True, high=1e9)
    check_number("--slo-tolerance", args.slo_tolerance, strict=True, high=1.0)
    for key in args.slo or {}:
        if key not in SLO_KEYS:
            raise ConfigError(f"--slo {key} is not a latency result key; use (mean|median|std|p50|p90|p99)_"
                              f"({'|'.join(latency.METRICS)})_ms, e.g. p99_ttft_ms")


def checked_goodput(items: list[str] | None) -> dict[str, float]:
    goodput = latency.parse_goodput(items)
    for name, ms in goodput.items():
        check_number(f"--goodput {name}", ms, strict=True, unit=" ms")
    return goodput


def check_cases(s: ServeSettings, cases: list[SimCase]) -> None:
    """What the backends need: a driver profile for each page size, paged books that fit in RAM, a cross-layer
    page that spreads evenly over the layers."""
    model = model_spec(s.spec.model, tp=s.spec.tensor_parallel_size)
    for case in cases:
        if case.layout == CROSS_LAYER:
            emulated_page(case.options["page_size"], model)
        profile(s.spec.driver_profile, s.spec.calibration, case.options.get("page_size"))
        block_size = case.options.get("block_size")
        if case.policy == "paged":
            check_int("paged-BLOCK", block_size, 1, MAX_MODEL_LEN)
            per_token = model_spec(s.spec.model, tp=s.spec.tensor_parallel_size).kv_shape().bytes_per_token
            blocks = s.budget_gb * 1e9 / (block_size * per_token)
            machine.check_fits_in_ram(f"--budget-gb {s.budget_gb:g} ({blocks:.3g} paged blocks of {block_size} "
                                     "tokens)", blocks * PAGED_BYTES_PER_BLOCK, "lower --budget-gb or raise BLOCK")


def _point(a: tuple[SimCase, ServeSpec, float, int]) -> dict[str, Any]:
    return run_point(*a)


def slo_jobs(s: ServeSettings, cases: list[SimCase]) -> tuple:
    """(a job's Search, the jobs, the searched key) for the SLO search's axis."""
    if s.search == "max-concurrency":
        rates = parse_rates(list(s.request_rates))
        if len(rates) != 1:
            raise ConfigError("--search max-concurrency runs at one rate: give one --request-rates value (or inf)")
        start = CONCURRENCY_START if s.slo_start is None else s.slo_start
        return (search_pool.concurrency_search, [(c, s.spec, seed, s.slo, start, rates[0], s.early_stop)
                                                 for c in cases for seed in s.seeds], "slo_max_concurrency")
    start = RATE_START if s.slo_start is None else s.slo_start
    return (search_pool.rate_search, [(c, s.spec, seed, s.slo, start, s.slo_tolerance, s.early_stop, None)
                                      for c in cases for seed in s.seeds], "slo_rate")


def run_searches(s: ServeSettings, cases: list[SimCase], saved: Saved | None = None) -> tuple[list[dict], str]:
    """Every (backend, seed) search, point by point over the workers (search_pool.py). On the rate axis, unless
    --independent-seeds: each backend's first seed searches from --slo-start; its other seeds then start at that
    answer with brackets one tolerance wide (slo.warm_step), as soon as it is known, which takes about a third of
    the runs. Every answer is still verified on its own seed: it passed at lo and missed at hi."""
    make, jobs, key = slo_jobs(s, cases)
    seeds = s.seeds
    order = {label: i for i, label in enumerate(backend_label(c) for c in cases)}

    def warm(first: dict[str, Any]) -> list[search_pool.Search]:
        """The backend's other seeds, started at its first seed's answer (none found: from --slo-start)."""
        if first["seed"] != seeds[0]:
            return []
        mine = [j for j in jobs if j[2] != seeds[0] and backend_label(j[0]) == first["backend"]]
        return [make((*j[:4], first[key], *j[5:7], slo.warm_step(s.slo_tolerance)) if first[key] > 0 else j)
                for j in mine]

    if s.search != "request-rate" or len(seeds) == 1 or s.independent_seeds:
        first, follow = [make(j) for j in jobs], lambda found: []
    else:
        first, follow = [make(j) for j in jobs if j[2] == seeds[0]], warm
        for search in first:
            search.gating = True
    found = search_pool.run_searches(search_pool.run_one, first, follow, len(jobs), s.jobs, s.progress, saved)
    return sorted(found, key=lambda f: (order[f["backend"]], f["seed"])), key


def run(args: argparse.Namespace) -> int:
    return simulate_serve(settings_from(args))


def simulate_serve(s: ServeSettings) -> int:
    cases = s.cases()
    labels = [backend_label(c) for c in cases]
    t0 = time.perf_counter()
    meta = {"spec": dataclasses.asdict(s.spec), "backends": labels, "seeds": list(s.seeds),
            "budget_gb": s.budget_gb, "watermark": s.watermark}
    saved = checkpoint_of(s, cases)
    s = dataclasses.replace(s, out=str(saved.checkpoint.out)) if saved else s      # save() writes there too
    with keeping(saved and saved.checkpoint, "simulate serve"):
        if s.slo:
            rows, result, text = slo_search(s, cases, labels, meta, saved)
        else:
            rows, result, text = rate_grid(s, cases, labels, saved)
    meta["host_seconds"] = time.perf_counter() - t0
    print(text)
    warning = short_run_warning(s.spec.num_requests, STEADY_REQUESTS, "request rates and goodput")
    if warning:
        print(warning)
    stopped = meta.get("runs_stopped_early", 0)
    print(f"\n{len(rows) + stopped} simulated runs ({stopped} stopped once their SLO was certainly missed) in "
          f"{meta['host_seconds']:.1f} s host time")
    if s.save:
        out = save(s, meta, result, rows, text)
        print(f"results in {out}/")
    return 0


def checkpoint_of(s: ServeSettings, cases: list[SimCase]) -> Saved | None:
    """Every finished point (a grid run, or a whole SLO search) kept as it finishes; None with --no-save."""
    total = len(cases) * len(s.seeds) * (1 if s.slo else len(s.request_rates))
    if s.slo:
        return saved_points(s, total, lambda job: f"{backend_label(job[0])} seed {job[2]} search", RUN_ONLY)
    return saved_points(s, total, lambda job: f"{backend_label(job[0])} rate {job[2]:g} seed {job[3]}", RUN_ONLY)


def slo_search(s: ServeSettings, cases: list[SimCase], labels: list[str], meta: dict,
               saved: Saved | None = None) -> tuple:
    """(rows with figures, result, table) of every (backend, seed) SLO search; counts the stopped runs in meta."""
    searches, key = run_searches(s, cases, saved)
    runs = [r for found in searches for r in found["runs"]]
    rows = [r for r in runs if not r.get("stopped_early")]       # the runs with figures
    meta["runs_stopped_early"] = len(runs) - len(rows)
    per = {b: [found[key] for found in searches if found["backend"] == b] for b in labels}
    result = {"slo": s.slo, "axis": s.search, **summary.slo_summary(per, labels[0], key),
              "searches": [{k: v for k, v in found.items() if k != "runs"} for found in searches]}
    return rows, result, slo_table(result, s.slo, s.spec, cases)


def rate_grid(s: ServeSettings, cases: list[SimCase], labels: list[str], saved: Saved | None = None) -> tuple:
    """(rows, result, table) of every backend at every rate and seed."""
    rates = parse_rates(list(s.request_rates))
    jobs = [(c, s.spec, r, seed) for c in cases for r in rates for seed in s.seeds]
    rows = pool_map(_point, jobs, s.jobs, s.progress, saved=saved)
    result = {"figures": summary.fold(rows), "ratios": summary.ratios(rows, labels[0])}
    return rows, result, grid_table(result["figures"], s.spec, cases)


RUN_ONLY = ("jobs", "progress", "out", "save", "plots", "resume", "argv")   # how to run and where, not what


def save(s: ServeSettings, meta: dict, result: dict, rows: list[dict], text: str) -> Path:
    from kvlab.experiments.reporting.provenance import jsonable, provenance, rows_json, write_provenance
    from kvlab.experiments.reporting.tables import results_dir
    out = results_dir(s.out)
    options = {k: v for k, v in dataclasses.asdict(s).items() if k not in RUN_ONLY}
    record = provenance({"command": "simulate serve", **options, "cases": meta["backends"]})
    write_provenance(out, record)
    (out / "report.txt").write_text(text + "\n")
    (out / "sim_serve.json").write_text(rows_json(jsonable({"provenance": record, "meta": meta, "result": result,
                                                            "runs": rows}), "runs"))
    with open(out / "sim_serve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        w.writeheader()
        w.writerows({**r, **r["driver"]} for r in rows)
    if s.plots:
        from kvlab.experiments.sim.serve.plots import plot_all
        plot_all(out, rows, result)
    return out

