"""`kvlab fallbacks`: which attention kernel each backend gets over a grid of model shapes, what it displaced
and why — the decisions vLLM logs only at debug level, made visible (and, with --measure, timed).

Decisions come from the kernel registry on simulated machines, so the CUDA rows are exact on a CPU machine:
deciding imports no kernel implementation (only --measure does, for kernels that run here).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvlab.common.machine import max_threads
from kvlab.common.validate import check_int
from kvlab.experiments.cli.flags import check_output_path
from kvlab.experiments.studies.fallbacks.grid import NUM_KV_HEADS, Grid, check_grid, default_scenarios, run_grid
from kvlab.experiments.studies.fallbacks.plot import plot_heatmap
from kvlab.experiments.studies.fallbacks.saving import save, scenario_meta
from kvlab.experiments.studies.fallbacks.summary import format_summary
from kvlab.experiments.studies.fallbacks.timing import format_timings, measure

# The study's modules import one way: decisions <- grid <- summary, saving, plot, timing <- this CLI.


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("fallbacks", help="which attention kernel each backend gets, and why",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = Grid()
    p.add_argument("--out", default=None, help="output directory (default results/fallbacks-<timestamp>/)")
    p.add_argument("--head-dims", type=int_list, default=g.head_dims, help="comma-separated head dims")
    p.add_argument("--dtypes", type=str_list, default=g.dtypes, help="comma-separated dtypes")
    p.add_argument("--block-sizes", type=int_list, default=g.block_sizes, help="comma-separated block sizes")
    p.add_argument("--gqa-ratios", type=int_list, default=g.gqa_ratios, help="comma-separated GQA ratios")
    p.add_argument("--kv-dtypes", type=str_list, default=g.kv_dtypes,
                   help="comma-separated KV-cache dtypes: auto, fp8_e4m3, fp8_e5m2 (default auto)")
    p.add_argument("--no-plot", action="store_true", help="skip the heat-map PNG")
    p.add_argument("--measure", action="store_true",
                   help="also time the kernels that run on this machine (chosen vs displaced where both run)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per kernel (median reported)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    grid = Grid(tuple(args.head_dims), tuple(args.dtypes), tuple(args.block_sizes), tuple(args.gqa_ratios),
                tuple(args.kv_dtypes))
    check_grid(grid)
    check_int("--threads", args.threads, 1, max_threads(), " (at most 4 per CPU)")
    check_int("--repeats", args.repeats, 1, 10_000)
    out = Path(args.out or f"results/fallbacks-{time.strftime('%Y%m%d-%H%M%S')}")
    check_output_path(str(out), "--out", directory=True)      # before the grid's progress bar
    scenarios = default_scenarios()
    rows = run_grid(grid, scenarios, progress=True)
    summary = format_summary(rows, scenarios, grid)
    meta: dict[str, Any] = {"grid": asdict(grid), "num_kv_heads": NUM_KV_HEADS,
                            "scenarios": [scenario_meta(s) for s in scenarios]}
    if args.measure:
        meta["measure"] = measure(rows, threads=args.threads, repeats=args.repeats,
                                  grid_values={"block_sizes": grid.block_sizes, "head_dims": grid.head_dims})
        summary += "\n\n" + format_timings(meta["measure"])
    paths = save(rows, out, summary, meta)
    if not args.no_plot:
        paths["png"] = plot_heatmap(rows, out / "fallbacks.png")
    print(summary)
    print("\nSaved: " + ", ".join(str(p) for p in paths.values()))
    return 0
