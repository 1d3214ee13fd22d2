"""`kvlab study corners`: the 2x2 of memory policy (static | elastic) x layout (contiguous | paged), one backend per
corner (reserve, paged, vmm, elastic), run through `kvlab bench`'s machinery on one workload and one KV budget, in
interleaved rounds. Each effect is a ratio of output throughput, paired by round (a machine-wide slowdown hits the
four runs of a round alike), reported as the geometric mean over rounds with a 95% t-interval:

- contiguity at fixed memory policy: reserve / paged (static), vmm / elastic (elastic);
- elasticity at fixed layout: vmm / reserve (contiguous), elastic / paged (paged);
- interaction: (vmm / elastic) / (reserve / paged), 1 when contiguity buys the same under both policies.

How to read it: docs/architecture.md "The 2x2".
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.bench.offline import DEFAULT_REPEATS, WARMUP_REQUESTS, check_capacity
from kvlab.experiments.bench.plan import (
    BenchSettings,
    built_figures,
    check_model_lens,
    check_settings,
    describe,
    load,
    make_plan,
)
from kvlab.experiments.bench.runs import mark_matching_outputs, run_rounds
from kvlab.experiments.cli import flags
from kvlab.experiments.workloads.requests import parse_workload

CORNERS = {"reserve": ("static", "contiguous"), "paged": ("static", "paged"),
           "vmm": ("elastic", "contiguous"), "elastic": ("elastic", "paged")}
EFFECTS = (("contiguity, static memory", "reserve", "paged"), ("contiguity, elastic memory", "vmm", "elastic"),
           ("elasticity, contiguous layout", "vmm", "reserve"), ("elasticity, paged layout", "elastic", "paged"))
# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; beyond, the normal's 1.96
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def add_study(which: Any) -> None:
    p = which.add_parser("corners", help="the 2x2: static/elastic memory x contiguous/paged layout",
                         description="reserve, paged, vmm and elastic on one workload and budget, interleaved "
                                     "rounds; what contiguity and elasticity each buy, and their interaction, with "
                                     "95% intervals (docs/architecture.md, The 2x2).")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--workload", type=flags.arg_type(parse_workload), default=parse_workload("seed"),
                   help="seed | fixed:P:O | uniform:PLO-PHI:OLO-OHI | trace:FILE.jsonl")
    p.add_argument("--scale", type=float, default=None, help="multiply every length (default 1/8 for seed)")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--warmup", type=int, default=WARMUP_REQUESTS)
    p.add_argument("--repeats", type=int, default=max(DEFAULT_REPEATS, 5), help="interleaved rounds (>= 2)")
    p.add_argument("--out", metavar="DIR", help="also write corners.json there")
    p.add_argument("--no-progress", action="store_true")
    flags.add_engine_flags(p, skip=("backend",))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 2:
        raise ConfigError(f"--repeats must be >= 2 for an interval, got {args.repeats}")
    engine_flags = {k: getattr(args, k, None) for k in ("config", *flags.engine_flag_names())}
    settings = BenchSettings(tuple(CORNERS), args.workload, args.num_requests, args.scale, args.max_len, args.rate,
                             args.warmup, args.repeats, args.out, "step", not args.no_progress, engine_flags)
    report = run_corners(settings)
    print(format_report(report))
    if args.out:
        path = Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "corners.json").write_text(json.dumps(report, indent=1))
        print(f"\nresults in {path}/corners.json")
    return 0


def run_corners(settings: BenchSettings) -> dict[str, Any]:
    import torch
    check_settings(settings)
    probe = settings.engine_config("paged")
    if probe.threads:
        torch.set_num_threads(probe.threads)
    model, tokenizer = load(probe)
    plan = make_plan(settings, model)
    same_page_size(plan, settings, model)
    check_model_lens(plan.configs, model)
    check_capacity(plan, model, tokenizer)
    print(describe(plan, model))
    runs = run_rounds(plan, model, tokenizer, settings.repeats, progress=settings.progress)
    mark_matching_outputs(runs)
    rounds = {r["backend"]: r["repeats_output_tokens_per_s"] for r in runs}
    return {"rounds": rounds, "effects": effects(rounds),
            "peak_mapped_bytes": {r["backend"]: r["peak_mapped_bytes"] for r in runs},
            "outputs_match_reserve": {r["backend"]: f"{r['outputs_match_first']}/{r['num_requests']}" for r in runs},
            "kernels": {r["backend"]: r["kernels"] for r in runs}}


def same_page_size(plan: Any, settings: BenchSettings, model: Any) -> None:
    """Elastic maps memory in pages of vmm's size (unless asked otherwise), so the two elastic corners differ in
    layout only."""
    if settings.engine_flags.get("elastic_page_size") is None:
        page = plan.configs["vmm"].options_of("vmm").page_size
        config = plan.configs["elastic"] = plan.configs["elastic"].replace(elastic_page_size=page)
        plan.built["elastic"] = built_figures(config, model.kv_shape(config.dtype, config.device))


def effects(rounds: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Each effect's per-round log ratio -> geometric mean and 95% t-interval; the interaction last."""
    logs = {b: [math.log(x) for x in xs] for b, xs in rounds.items()}
    out = []
    for name, num, den in EFFECTS:
        out.append({"effect": name, "ratio": f"{num} / {den}",
                    **interval([a - b for a, b in zip(logs[num], logs[den])])})
    inter = [(v - e) - (r - p) for v, e, r, p in zip(logs["vmm"], logs["elastic"], logs["reserve"], logs["paged"])]
    out.append({"effect": "interaction", "ratio": "(vmm / elastic) / (reserve / paged)", **interval(inter)})
    return out


def interval(log_ratios: list[float]) -> dict[str, float]:
    n = len(log_ratios)
    mean = sum(log_ratios) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in log_ratios) / (n - 1)) if n > 1 else float("inf")
    half = (T95[n - 2] if n - 1 <= len(T95) else 1.96) * sd / math.sqrt(n)
    return {"mean": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "rounds": n}


def format_report(report: dict[str, Any]) -> str:
    med = {b: sorted(xs)[(len(xs) - 1) // 2] for b, xs in report["rounds"].items()}
    mib = {b: v / 2**20 for b, v in report["peak_mapped_bytes"].items()}
    lines = ["", "output tok/s, median of the rounds (peak mapped KV MiB)",
             f"{'':>9}  {'contiguous':>24}  {'paged':>24}"]
    for policy, (left, right) in (("static", ("reserve", "paged")), ("elastic", ("vmm", "elastic"))):
        cells = [f"{b} {med[b]:.1f} ({mib[b]:.1f})" for b in (left, right)]
        lines.append(f"{policy:>9}  {cells[0]:>24}  {cells[1]:>24}")
    lines += ["", "effect on output tok/s (geometric mean over rounds, 95% t-interval; > 1: the first is faster)"]
    for e in report["effects"]:
        verdict = "" if e["low"] <= 1 <= e["high"] else "  (interval excludes 1)"
        lines.append(f"  {e['effect']:<30} {e['ratio']:<38} {e['mean']:.3f} [{e['low']:.3f}, {e['high']:.3f}]"
                     f"{verdict}")
    lines += ["", "outputs = reserve's: " + ", ".join(f"{b} {v}" for b, v in report["outputs_match_reserve"].items())]
    return "\n".join(lines)
