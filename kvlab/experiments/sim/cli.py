"""`kvlab simulate`: the command line of the roofline simulator (experiments/sim/core.py) and the seed
article's tables (experiments/sim/seed_article.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.common import machine
from kvlab.common.config import load_toml
from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import get_backend
from kvlab.common.limits import MAX_MODEL_LEN
from kvlab.common.validate import check_int, check_number
from kvlab.experiments.cli import flags
from kvlab.experiments.limits import MAX_BUDGET_GB
from kvlab.experiments.reporting.provenance import provenance, write_provenance
from kvlab.experiments.reporting.tables import changes_line, results_dir
from kvlab.experiments.sim.core import (
    SimCase,
    SimRow,
    SimSettings,
    declared_options,
    policies,
    policy_backend,
    run_cases,
)
from kvlab.experiments.sim.kernels import CHOICES, kernel_profile
from kvlab.experiments.sim.layouts import CROSS_LAYER, LAYOUT_OPTION, add_layout_flags, check_layout
from kvlab.experiments.sim.roofline import HARDWARE, hardware, model_spec
from kvlab.experiments.workloads.requests import WorkloadSpec, build_workload, parse_workload

PAGED_BYTES_PER_BLOCK = 160      # measured: 2**20 accounting-only blocks take ~145 MiB


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate", help="roofline simulation at GPU scale (real scheduler, accounting-only caches)",
        description="Serve a workload with the real scheduler and accounting-only caches on a roofline clock.")
    p.add_argument("--preset", choices=["seed", "fp8", "window"],
                   help="seed: the seed article's tables; fp8: bf16 vs fp8 KV (Llama-3-8B); window: Mistral-7B "
                        "sliding window vs full attention at 32K (experiments/sim/kv_presets.py)")
    p.add_argument("--worked-example", action="store_true", help="the article's hand examples, by the backends")
    p.add_argument("--policies", type=flags.parse_list, default=["reserve", "oracle", "paged"],
                   help=f"comma list of {', '.join(policies())}")
    p.add_argument("--budget-gb", type=float, default=60.0,
                   help="KV budget in GB (1e9 bytes); with --tensor-parallel-size > 1, per GPU")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--page-size", type=flags.parse_bytes, default=2 * 2**20)
    p.add_argument("--watermark", type=float, default=0.05, help="admission watermark (paged, vmm)")
    add_layout_flags(p, "the vmm policy")
    p.add_argument("--workload", type=flags.arg_type(parse_workload), default=parse_workload("seed"),
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
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="model TP over this many GPUs: per-rank weights and KV heads, 2 ring all-reduces per layer "
                        "over the hardware's NVLink (docs/tensor-parallel.md, Simulator)")
    p.add_argument("--model-prefill", action="store_true", help="charge prefill as flops / (peak x mfu)")
    p.add_argument("--kernel-costs", default="none", metavar="PROFILE",
                   help=f"attention kernel speed by KV layout: {CHOICES} (default none: the plain roofline; "
                        "docs/kernel-costs.md)")
    p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument("--config", metavar="FILE", help="TOML with engine overrides (e.g. max_num_seqs)")
    p.add_argument("--max-num-seqs", type=int, help="cap the batch (default: unbounded, as the article)")
    p.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (default: unbounded)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes for independent runs")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>/): rows.json, "
                                                   "batch.png, report.txt")
    p.add_argument("--json", metavar="PATH", help='write {"rows": [...]} to PATH only (no results directory)')
    p.add_argument("--plot", metavar="PNG", help="running batch over simulated time to PNG only (no results directory)")
    p.add_argument("--no-save", action="store_true", help="print only; write no files")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)
    from kvlab.experiments.sim.pd import cli as pd_cli
    from kvlab.experiments.sim.pool import cli as pool_cli
    from kvlab.experiments.sim.serve import cli as serve_cli
    commands = p.add_subparsers(dest="simulate_command", metavar="serve | pool | pd", required=False)
    for command in (serve_cli, pool_cli, pd_cli):
        command.add_parser(commands)


@dataclass(frozen=True)
class SimulateOptions:
    """What `kvlab simulate` was asked for, built once from its flags (options_from)."""
    preset: str | None
    policies: tuple[str, ...]
    budget_gb: float
    block_size: int
    page_size: int
    watermark: float
    vmm_layouts: tuple[str, ...]     # each vmm policy runs once in each layout
    layout_penalty: str              # a cross-layer case's attention penalty (layouts.py)
    workload: WorkloadSpec           # the --workload kind with its sizes, seed, rate and scale filled in
    seeds: int
    hardware: str
    model: str
    tensor_parallel_size: int
    model_prefill: bool
    mfu: float
    kernel_costs: str                # none | published | cpu | measured:FILE
    config: str | None               # TOML with engine overrides
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    jobs: int
    out: str | None
    json: str | None
    plot: str | None
    no_save: bool
    progress: bool


def run_kv_preset(opts: SimulateOptions, settings: SimSettings, t0: float) -> int:
    """fp8 or window: two variants of every backend; report.txt, rows.json (each row names its variant),
    batch.png and provenance.json, as every simulate run."""
    from kvlab.experiments.sim import kv_presets
    if opts.preset == "fp8":
        variants, title = kv_presets.fp8_variants(settings), f"{settings.model}: bf16 KV vs fp8_e4m3 KV"
        print(changes_line(settings.workload, scale_given=opts.workload.scale != 1.0))
    else:
        variants, title = kv_presets.window_variants(settings), "Mistral-7B: full attention vs sliding window 4096"
        print(kv_presets.WINDOW_CHANGES)
    rows = kv_presets.run_pair(variants, opts.jobs, opts.progress)
    text = kv_presets.report(title, rows)
    print(text)
    print(f"\n{time.perf_counter() - t0:.1f} s host time")
    write_variant_outputs(opts, text, rows, variants)
    return 0


def write_variant_outputs(opts: SimulateOptions, text: str, rows: dict[str, list[SimRow]],
                          variants: dict[str, SimSettings]) -> None:
    """Each row names its variant; the provenance holds each variant's settings, the ones that ran."""
    labelled = [({"variant": name, **r.to_json()}, batch_series([r], f"{name} ")) for name, rs in rows.items()
                for r in rs]
    write_files(opts, text, [row for row, _ in labelled], [s for _, series in labelled for s in series],
                run_record(opts, variants))


def sim_settings(opts: SimulateOptions) -> SimSettings:
    """The simulator's settings; a bad hardware, model or workload fails here, before any worker starts."""
    spec = opts.workload
    engine = load_toml(opts.config) if opts.config else {}
    engine.update({k: v for k, v in (("max_num_seqs", opts.max_num_seqs),
                                     ("max_num_batched_tokens", opts.max_num_batched_tokens)) if v is not None})
    hardware(opts.hardware)          # fail fast on bad input, before any worker starts
    model_spec(opts.model, tp=opts.tensor_parallel_size)
    build_workload(spec)
    kernel_profile(opts.kernel_costs)
    return SimSettings(workload=spec, hardware=opts.hardware, model=opts.model, model_prefill=opts.model_prefill,
                       mfu=opts.mfu, engine=engine, timeline_every=5 if wants_plot(opts) else 0,
                       tensor_parallel_size=opts.tensor_parallel_size, kernel_costs=opts.kernel_costs,
                       layout_penalty=opts.layout_penalty)


def wants_plot(opts: SimulateOptions) -> bool:
    return bool(opts.plot) or not (opts.json or opts.no_save)


def output_paths(opts: SimulateOptions) -> tuple[Path | None, str | None, str | None]:
    """(results dir, rows JSON, plot PNG): explicit --json/--plot paths alone, else results/<timestamp>/."""
    if opts.no_save or ((opts.json or opts.plot) and not opts.out):
        return None, opts.json, opts.plot
    out = results_dir(opts.out)
    return out, opts.json or str(out / "rows.json"), opts.plot or str(out / "batch.png")


def cases_from(opts: SimulateOptions) -> list[SimCase]:
    """One case per policy; the vmm policy once per --vmm-layout."""
    cases = []
    for policy in opts.policies:
        growing = get_backend(policy_backend(policy)).watermark
        options = declared_options(policy, {"block_size": opts.block_size, "page_size": opts.page_size,
                                            "elastic_block_size": opts.block_size, "elastic_page_size": opts.page_size})
        layouts = opts.vmm_layouts if policy_backend(policy) == "vmm" else ("per-layer",)
        for layout in layouts:
            extra = {LAYOUT_OPTION: CROSS_LAYER} if check_layout(layout) == CROSS_LAYER else {}
            cases.append(SimCase(policy, opts.budget_gb, watermark=opts.watermark if growing else 0.0,
                                 **options, **extra))
    return cases


def check_options(opts: SimulateOptions) -> None:
    """Every value bounded before a worker starts or a cache is sized; output paths writable before the run."""
    check_number("--budget-gb", opts.budget_gb, strict=True, high=MAX_BUDGET_GB)
    check_number("--watermark", opts.watermark, high=0.999)
    check_number("--mfu", opts.mfu, strict=True, high=1.0)
    check_int("--jobs", opts.jobs, 1, machine.max_threads(), " (at most 4 per CPU)")
    check_int("--seeds", opts.seeds, 1, 1000)
    check_int("--block-size", opts.block_size, 1, MAX_MODEL_LEN)
    check_int("--tensor-parallel-size", opts.tensor_parallel_size, 1, 1024)
    for flag, value in (("--max-num-seqs", opts.max_num_seqs), ("--max-num-batched-tokens",
                                                               opts.max_num_batched_tokens)):
        if value is not None:
            check_int(flag, value, 1, MAX_MODEL_LEN)
    for layout in opts.vmm_layouts:
        check_layout(layout)
    if opts.preset is None:
        cases_from(opts)                                   # an unknown policy or option fails here
    check_paged_bookkeeping(opts)
    flags.check_output_path(opts.json, "--json")
    flags.check_output_path(opts.plot, "--plot")
    if not opts.no_save:
        flags.check_output_path(opts.out, "--out", directory=True)


def check_paged_bookkeeping(opts: SimulateOptions) -> None:
    """Accounting-only caches allocate no KV, but the paged block pool keeps ~160 B of books per block."""
    if "paged" not in opts.policies and opts.preset != "seed":
        return
    block_size = 16 if opts.preset == "seed" else opts.block_size     # the seed tables' smallest block
    per_token = model_spec(opts.model, tp=opts.tensor_parallel_size).kv_shape().bytes_per_token
    blocks = opts.budget_gb * 1e9 / (block_size * per_token)
    machine.check_fits_in_ram(f"--budget-gb {opts.budget_gb:g} ({blocks:.3g} paged blocks of {block_size} tokens)",
                      blocks * PAGED_BYTES_PER_BLOCK, "lower --budget-gb or raise --block-size")


def run(args: argparse.Namespace) -> int:
    if args.worked_example:
        from kvlab.experiments.sim.worked_example import print_worked_example
        print_worked_example()
        if not args.preset:
            return 0
    return simulate(options_from(args))


def options_from(args: argparse.Namespace) -> SimulateOptions:
    """The one place `kvlab simulate`'s flags are read."""
    spec = dataclasses.replace(args.workload, num_requests=args.num_requests, seed=args.seed, rate=args.rate,
                               scale=args.scale, max_len=args.max_len)
    return SimulateOptions(
        preset=args.preset, policies=tuple(args.policies), budget_gb=args.budget_gb, block_size=args.block_size,
        page_size=args.page_size, watermark=args.watermark, vmm_layouts=tuple(args.vmm_layout),
        layout_penalty=args.layout_penalty, workload=spec, seeds=args.seeds, hardware=args.hardware,
        model=args.model, tensor_parallel_size=args.tensor_parallel_size, model_prefill=args.model_prefill,
        mfu=args.mfu, kernel_costs=args.kernel_costs, config=args.config, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, jobs=args.jobs, out=args.out, json=args.json,
        plot=args.plot, no_save=args.no_save, progress=not args.no_progress)


def simulate(opts: SimulateOptions) -> int:
    if opts.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {opts.seeds}")
    check_options(opts)
    settings = sim_settings(opts)
    if opts.preset in ("fp8", "window"):                   # each prints the workload it runs
        return run_kv_preset(opts, settings, time.perf_counter())
    print(changes_line(settings.workload, scale_given=opts.workload.scale != 1.0))
    t0 = time.perf_counter()
    if opts.preset == "seed" and opts.seeds > 1:
        from kvlab.experiments.sim import seed_article
        text = seed_article.spread(settings, opts.seeds, opts.jobs, opts.progress)
        print(text)
        print(f"\n{time.perf_counter() - t0:.1f} s host time")
        save_report(opts, text)
        return 0
    cases, rows, plotted, text = run_simulations(opts, settings)
    print(f"\n{len({c.key for c in cases})} simulations in {time.perf_counter() - t0:.1f} s host time "
          f"(longest {max(r.wall_seconds for r in rows):.1f} s)")
    write_outputs(opts, text, rows, plotted)
    return 0


def run_simulations(opts: SimulateOptions, settings: SimSettings) -> tuple:
    """(cases, rows, the rows plotted, the report printed): the seed article's tables, or one row per policy."""
    if opts.preset == "seed":
        from kvlab.experiments.sim import seed_article
        cases = seed_article.cases()
        rows = run_cases(cases, settings, opts.jobs, opts.progress)
        text = seed_article.report(cases, rows, settings)
        print(text)
        plotted = list({c.key: r for c, r in zip(cases, rows) if c.key in seed_article.PLOTTED}.values())
        return cases, rows, plotted, text
    cases = cases_from(opts)
    rows = run_cases(cases, settings, opts.jobs, opts.progress)
    text = plain_report(rows, settings)
    print(text)
    return cases, rows, rows, text


def write_outputs(opts: SimulateOptions, text: str, rows: list[SimRow], plotted: list[SimRow]) -> None:
    write_files(opts, text, [r.to_json() for r in rows], batch_series(plotted), run_record(opts))


def write_files(opts: SimulateOptions, text: str, rows: list[dict], series: list, record: dict) -> None:
    """report.txt and provenance.json in the results directory; the rows JSON and the plot there or where asked."""
    out, json_path, plot_path = output_paths(opts)
    if out is not None:
        write_provenance(out, record)
        (out / "report.txt").write_text(text + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps({"provenance": record, "rows": rows}, indent=1))
        print(f"rows written to {json_path}")
    if plot_path:
        plot_batches(plot_path, series)
        print(f"plot written to {plot_path}")
    if out is not None:
        print(f"results in {out}/ (provenance.json, report.txt, rows.json, batch.png)")


RUN_ONLY = ("jobs", "out", "json", "plot", "no_save", "progress")    # how to run and where to write, not what


def run_record(opts: SimulateOptions, variants: dict[str, SimSettings] | None = None) -> dict:
    """The provenance of a simulate run: its options (not where it writes) and the settings resolved from them,
    or a preset's variants' settings (the ones its runs used)."""
    options = {k: v for k, v in dataclasses.asdict(opts).items() if k not in RUN_ONLY}
    resolved = {"variants": variants} if variants else {"settings": sim_settings(opts)}
    return provenance({"command": "simulate", **options, **resolved})


def save_report(opts: SimulateOptions, text: str) -> None:
    out = output_paths(opts)[0]
    if out is not None:
        write_provenance(out, run_record(opts))
        (out / "report.txt").write_text(text + "\n")
        print(f"report written to {out / 'report.txt'}")


def plain_report(rows: list[SimRow], settings: SimSettings) -> str:
    from kvlab.experiments.reporting.tables import fmt, pct, table
    tp = settings.tensor_parallel_size
    on = f"{tp} x {settings.hardware} (tensor parallel, GB per GPU)" if tp > 1 else settings.hardware
    title = (f"{settings.workload.num_requests} requests ({settings.workload.kind}), {settings.model} on "
             f"{on}, prefill {'modelled' if settings.model_prefill else 'ignored'}")
    if settings.kernel_costs != "none":
        title += f", kernel costs {settings.kernel_costs}"
    if settings.layout_penalty != "none" and any(r.label.endswith("-crosslayer") for r in rows):
        title += f", cross-layer attention penalty {settings.layout_penalty}"
    body = [[r.label, f"{r.budget_gb:g}", pct(r.watermark, 0), fmt(r.mean_batch), pct(r.kv_utilization),
             fmt(r.output_tokens_per_s), r.preemptions, fmt(r.mean_waste_tokens), f"{r.sim_seconds:.3g}"]
            for r in rows]
    headers = ["policy", "GB", "wm", "mean batch", "util", "tok/s", "preempt", "end waste", "sim s"]
    if tp > 1:
        for line, r in zip(body, rows):
            line.append(pct(r.allreduce_seconds / r.sim_seconds if r.sim_seconds else 0.0))
        headers.append("all-reduce")
    if settings.kernel_costs != "none":
        for line, r in zip(body, rows):
            line.append(pct(r.attention_share))
        headers.append("attention")
    return table(headers, body, title)


def batch_series(rows: list[SimRow], prefix: str = "") -> list:
    from kvlab.experiments.reporting.plots import Series, downsample
    return [downsample(Series(f"{prefix}{r.label} {fmt_gb(r.budget_gb)} wm {r.watermark:g}", r.timeline["time"],
                              r.timeline["running"])) for r in rows if r.timeline]


def plot_batches(path: str, series: list) -> None:
    """Running sequences against simulated seconds: a long step weighs its length here, while a table's mean
    batch counts every step once, so a run that drains in many short steps plots above its mean batch."""
    from kvlab.experiments.reporting.plots import line_chart
    line_chart(path, series, "simulated seconds", "running sequences",
               "Running batch over simulated time (tables: mean per step)")


def fmt_gb(gb: float) -> str:
    return f"{gb:g} GB"
