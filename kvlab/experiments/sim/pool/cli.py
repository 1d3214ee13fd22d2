"""`kvlab simulate pool`: N models on one GPU under phase-shifted bursts, the same total KV memory arranged as
one elastic shared pool (vmm) or a static equal split (paged, vmm, reserve); per-model p99 TTFT / TPOT and SLO
attainment at given total rates, or an SLO search on the total rate with bootstrap intervals over seeds."""
from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_int, check_number
from kvlab.experiments.cli import flags
from kvlab.experiments.limits import MAX_REQUESTS
from kvlab.experiments.loadgen.rows import parse_rates
from kvlab.experiments.reporting.checkpoint import keeping
from kvlab.experiments.sim.gpu_figures import MEMORY_UTILIZATION, kv_budget_gb
from kvlab.experiments.sim.pool.onoff import OnOff
from kvlab.experiments.sim.pool.run import Arrangement, PoolSpec, parse_arrangements, run_point
from kvlab.experiments.sim.results import report
from kvlab.experiments.sim.serve import slo, summary
from kvlab.experiments.sim.serve.cli import check_run_flags, checked_goodput
from kvlab.experiments.sim.serve.costs import PROFILES, profile
from kvlab.experiments.sim.serve.grid import Saved, pool_map, saved_points
from kvlab.experiments.sim.serve.run import ServeSpec
from kvlab.experiments.sim.serve.stats import spread

DEFAULT_ARRANGEMENTS = ["shared:vmm-2MiB", "shared:elastic-16", "aware:vmm-2MiB", "split:paged-16", "split:vmm-2MiB"]
MODEL_KEYS = ("p99_ttft_ms", "p99_tpot_ms", "slo_attainment", "server_preemptions", "pages_received")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("pool", help="N models on one GPU: one elastic KV pool against static splits",
                              description="N engines time-sharing one GPU under phase-shifted on/off bursts; the "
                                          "same total KV memory as one shared pool (vmm or elastic engines) or a "
                                          "static equal split.")
    p.add_argument("--models", type=int, default=3, help="engines (models) on the GPU")
    p.add_argument("--arrangements", type=flags.parse_list, default=DEFAULT_ARRANGEMENTS,
                   help="comma list: shared:vmm-SIZE (one pool), shared:elastic-BLOCK[-SIZE] (elastic engines on the "
                        "pool, 2MiB pages unless given), aware:vmm-SIZE (the pool with pool-aware admission), "
                        "split:BACKEND (equal static split; paged-16, vmm-2MiB, elastic-16, reserve)")
    p.add_argument("--budget-gb", type=float, help="total KV GB (default: the GPU's memory x "
                                                   f"{MEMORY_UTILIZATION} less every engine's weights)")
    p.add_argument("--total-rates", type=flags.parse_list, default=["8"], help="comma list of total req/s")
    p.add_argument("--period-s", type=float, default=60.0, help="one on/off cycle: every model bursts once")
    p.add_argument("--periods", type=int, default=2)
    p.add_argument("--duty", type=float, default=1.0, help="fraction of its phase a model bursts")
    p.add_argument("--idle-share", type=float, default=0.0, help="a model's rate between bursts / its burst rate")
    flags.add_fleet_workload_flags(p)
    p.add_argument("--ignore-prefill", action="store_true")
    p.add_argument("--driver-costs", default="cuda-a100", help=" | ".join(PROFILES))
    p.add_argument("--background-mapping", action="store_true")
    p.add_argument("--slo", type=flags.arg_type(slo.parse_slo),
                   help="search the highest total rate at which every model meets e.g. p99_ttft_ms<=2000,"
                        "p99_tpot_ms<=100")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="per-request targets for SLO attainment and goodput: ttft:MS tpot:MS (default: --slo's)")
    flags.add_search_run_flags(p)
    p.set_defaults(run=run)


@dataclass(frozen=True)
class PoolSettings:
    spec: PoolSpec
    arrangements: tuple[Arrangement, ...]
    budget_gb: float
    rates: tuple[float, ...]
    seeds: tuple[int, ...]
    slo_start: float
    slo_tolerance: float
    jobs: int
    progress: bool
    out: str | None
    save: bool
    resume: str | None = None               # the results directory of an interrupted run to finish
    argv: tuple[str, ...] = ()              # the command line, stored for --resume


def settings_from(args: argparse.Namespace) -> PoolSettings:
    models = check_int("--models", args.models, 1, 64)
    for flag in ("--max-len", "--input-len", "--output-len"):
        check_int(flag, getattr(args, flag[2:].replace("-", "_")), 1, 1 << 20, " (tokens per sequence)")
    check_onoff(args)
    if args.driver_costs not in PROFILES:
        raise ConfigError(f"unknown --driver-costs {args.driver_costs!r}; choose {', '.join(PROFILES)}")
    args.budget_gb = kv_budget_gb(args.hardware, args.model, models) if args.budget_gb is None else args.budget_gb
    args.seeds = args.seeds if args.seeds is not None else 1
    args.slo = args.slo or {}
    check_run_flags(args)
    if args.out is not None and not args.no_save:
        flags.check_output_path(args.out, "--out", directory=True)
    serve = ServeSpec(dataset=args.dataset, scale=args.scale, max_len=args.max_len, input_len=args.input_len,
                      output_len=args.output_len, burstiness=args.burstiness, hardware=args.hardware,
                      model=args.model, model_prefill=not args.ignore_prefill, mfu=args.mfu,
                      driver_profile=args.driver_costs, background_mapping=args.background_mapping,
                      goodput=checked_goodput(args.goodput))
    onoff = OnOff(models, args.period_s, args.periods, args.duty, args.idle_share, args.burstiness)
    arrangements = tuple(parse_arrangements(list(args.arrangements), args.budget_gb, args.watermark))
    for arr in arrangements:
        profile(args.driver_costs, None, arr.case.options.get("page_size", arr.case.options.get("elastic_page_size")))
    return PoolSettings(PoolSpec(serve, onoff, dict(args.slo)), arrangements, args.budget_gb,
                        tuple(parse_rates(list(args.total_rates))), tuple(range(args.seed, args.seed + args.seeds)),
                        args.slo_start, args.slo_tolerance, args.jobs, not args.no_progress, args.resume or args.out,
                        not args.no_save, args.resume, tuple(getattr(args, "command_line", ())))


def check_onoff(args: argparse.Namespace) -> None:
    check_number("--period-s", args.period_s, strict=True, high=86400.0, unit=" s")
    check_int("--periods", args.periods, 1, 1000)
    check_number("--duty", args.duty, strict=True, high=1.0)
    check_number("--idle-share", args.idle_share, high=1.0)
    check_number("--burstiness", args.burstiness, low=1e-3, high=1e3)
    check_number("--scale", args.scale, strict=True, high=1e6)
    duration = args.period_s * args.periods
    for rate in parse_rates(list(args.total_rates)):
        check_number("--total-rates", rate, strict=True, high=MAX_REQUESTS / duration,
                     unit=f" req/s (at most {MAX_REQUESTS:,} requests in {duration:g} s)")


def _point(a: tuple) -> dict[str, Any]:
    return run_point(*a)


def _search(a: tuple[Arrangement, PoolSpec, int, float, float]) -> dict[str, Any]:
    arr, spec, seed, start, tol = a
    found = slo.search(lambda rate: run_point(arr, spec, rate, seed, stop_on_miss=spec.slo), spec.slo, start, tol,
                       high_limit=MAX_REQUESTS / spec.onoff.duration_s / 2)
    passing = found.results.get(found.rate, {})
    return {"arrangement": arr.label, "seed": seed, "slo_rate": found.rate, "evaluations": found.evaluations,
            "at_slo_rate": passing, "runs": len(found.results)}


def run(args: argparse.Namespace) -> int:
    return simulate_pool(settings_from(args))


def simulate_pool(s: PoolSettings) -> int:
    t0 = time.perf_counter()
    labels = [a.label for a in s.arrangements]
    saved = checkpoint_of(s)
    s = dataclasses.replace(s, out=str(saved.checkpoint.out)) if saved else s      # save() writes there too
    with keeping(saved and saved.checkpoint, "simulate pool"):
        if s.spec.slo:
            searches = pool_map(_search, [(a, s.spec, seed, s.slo_start, s.slo_tolerance) for a in s.arrangements
                                          for seed in s.seeds], s.jobs, s.progress, "search", "simulate pool", saved)
            per = {label: [f["slo_rate"] for f in searches if f["arrangement"] == label] for label in labels}
            result = {"slo": s.spec.slo, **summary.slo_summary(per, labels[0]), "searches": searches}
            text = slo_table(result, searches, s)
        else:
            rows = pool_map(_point, [(a, s.spec, rate, seed) for a in s.arrangements for rate in s.rates
                                     for seed in s.seeds], s.jobs, s.progress, desc="simulate pool", saved=saved)
            result = {"runs": rows}
            text = grid_table(rows, s)
    meta = {"spec": dataclasses.asdict(s.spec), "arrangements": labels, "budget_gb": s.budget_gb,
            "seeds": list(s.seeds)}
    report(text, t0, (s.out, "simulate pool", "sim_pool.json", meta, result) if s.save else None)
    return 0


def checkpoint_of(s: PoolSettings) -> Saved | None:
    """Every finished point (a run, or a whole SLO search) kept as it finishes; None with --no-save."""
    total = len(s.arrangements) * len(s.seeds) * (1 if s.spec.slo else len(s.rates))
    if s.spec.slo:
        return saved_points(s, total, lambda job: f"{job[0].label} seed {job[2]} search", RUN_ONLY)
    return saved_points(s, total, lambda job: f"{job[0].label} rate {job[2]:g} seed {job[3]}", RUN_ONLY)


RUN_ONLY = ("jobs", "progress", "out", "save", "resume", "argv")      # how to run and where, not what


def workload_line(s: PoolSettings) -> str:
    o, v = s.spec.onoff, s.spec.serve
    return (f"{o.models} x {v.model} on one {v.hardware}, {s.budget_gb:.1f} GB of KV in all; on/off bursts "
            f"(period {o.period_s:g} s x {o.periods}, duty {o.duty:g}, idle share {o.idle_share:g}), {v.dataset} "
            f"lengths; driver costs {v.driver_profile} ({PROFILES[v.driver_profile].source})")


def model_cells(runs: list[dict[str, Any]], model: int) -> list[str]:
    """One model's figures over seeds (mean ± std), from the runs that have figures."""
    cells = []
    for key in MODEL_KEYS:
        values = [r["per_model"][model][key] for r in runs if "per_model" in r
                  and r["per_model"][model][key] is not None]
        cells.append(pm(spread(values)) if values else "-")
    return cells


def pm(s: dict[str, float]) -> str:
    return plain(s["mean"]) if s["n"] == 1 else f"{plain(s['mean'])} ± {s['std']:.2g}"


def plain(value: float) -> str:
    """4 significant digits without an exponent: 11,840 rather than 1.184e+04."""
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def over_seeds(seeds: tuple[int, ...]) -> str:
    return " (mean ± std over seeds)" if len(seeds) > 1 else " (one seed: no spread)"


def grid_table(rows: list[dict[str, Any]], s: PoolSettings) -> str:
    from kvlab.experiments.reporting.tables import table
    body = []
    for arr in s.arrangements:
        for rate in s.rates:
            mine = [r for r in rows if r["arrangement"] == arr.label and r["total_rate"] == rate]
            body += [[arr.label, f"{rate:g}", f"model {m}", *model_cells(mine, m)] for m in range(s.spec.models)]
    return table(["arrangement", "total rate", "model", *MODEL_KEYS], body,
                 workload_line(s) + over_seeds(s.seeds))


def slo_table(result: dict[str, Any], searches: list[dict[str, Any]], s: PoolSettings) -> str:
    from kvlab.experiments.reporting.tables import table
    body = []
    for label, r in result["backends"].items():
        ratio = result["ratios"].get(label)
        rel = f"{ratio['ratio']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]" if ratio else "1 (reference)"
        at = [f["at_slo_rate"] for f in searches if f["arrangement"] == label]
        worst = [model_cells(at, m) for m in range(s.spec.models)]
        body.append([label, f"{r['slo_rate']:.3g}", f"[{r['ci95'][0]:.3g}, {r['ci95'][1]:.3g}]", rel,
                     " / ".join(w[0] for w in worst), " / ".join(w[1] for w in worst),
                     " / ".join(w[2] for w in worst)])
    goal = ", ".join(f"{k} <= {v:g}" for k, v in s.spec.slo.items())
    return table(["arrangement", "SLO total rate", "95% CI", "ratio [95% CI]", "p99 TTFT ms per model",
                  "p99 TPOT ms per model", "attainment per model"], body,
                 f"Highest total rate at which every model meets {goal}; {workload_line(s)}")
