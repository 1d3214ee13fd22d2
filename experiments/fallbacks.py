"""`kvlab fallbacks`: which attention kernel each backend gets over a grid of model shapes, what it displaced
and why — the decisions vLLM logs only at debug level, made visible (and, with --measure, timed).

Decisions come from `common.kernels.decide` on simulated machines, so the CUDA rows are exact on a CPU
machine: deciding imports no kernel implementation (only --measure does, for kernels that run here).
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlab.common.attention.dispatch import PHASES, AttentionSpec
from kvlab.common.attention.kernels import (
    CAUSES,
    Environment,
    decide,
    kernel_head_dim,
    priority,
    reason_cause,
    simulated,
)
from kvlab.common.errors import ConfigError

BACKEND_LAYOUTS = {"paged": "paged", "vmm": "contiguous"}
NUM_KV_HEADS = 2
H200_CC = (9, 0)
EXTRA_PACKAGES = ("flash_attn", "flashinfer")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class Grid:
    head_dims: tuple[int, ...] = (64, 72, 80, 96, 100, 112, 128, 192, 256)
    dtypes: tuple[str, ...] = DTYPES
    block_sizes: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)
    gqa_ratios: tuple[int, ...] = (1, 3, 4, 8)

    def num_rows(self, num_scenarios: int) -> int:
        """Paged rows vary with block size; vmm (contiguous, no blocks) rows do not."""
        shapes = len(self.head_dims) * len(self.dtypes) * len(self.gqa_ratios)
        return num_scenarios * len(PHASES) * shapes * (len(self.block_sizes) + 1)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    label: str
    device: str
    compute_capability: tuple[int, int] | None
    env: Environment


def default_scenarios() -> list[Scenario]:
    """This CPU as it is; an H200 (cc 9.0) with this machine's packages (the H200 of gpu-apis.md §0 has the
    same: triton and torch's flex_attention, no flash-attn, no FlashInfer); the H200 with both installed."""
    here = simulated()
    gpu = simulated(triton_interpret=False)   # a GPU machine compiles Triton kernels
    return [
        Scenario("cpu", "cpu (as installed)", "cpu", None, Environment(here.packages, None)),
        Scenario("cuda", "cuda cc 9.0 (as installed here)", "cuda", H200_CC, gpu),
        Scenario("cuda+fa+fi", "cuda cc 9.0 (+flash-attn, flashinfer)", "cuda", H200_CC,
                 simulated(*EXTRA_PACKAGES, triton_interpret=False)),
    ]


@dataclass(slots=True)
class Row:
    """One decision: a grid point x backend x phase in one scenario."""
    scenario: str
    device: str
    compute_capability: str | None
    packages: list[str]
    backend: str
    layout: str
    phase: str
    head_dim: int
    dtype: str
    block_size: int | None
    gqa_ratio: int
    num_q_heads: int
    num_kv_heads: int
    kernel: str
    kernel_head_dim: int               # the head dim the kernel computes with (padding)
    preferred: str                     # the device's first-priority kernel for this layout
    fallback: bool                     # a higher-priority kernel was refused
    displaced: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)              # rule families that refused the displaced
    reasons: dict[str, list[str]] = field(default_factory=dict)  # displaced kernel -> reasons
    refused: dict[str, list[str]] = field(default_factory=dict)  # every refused kernel this phase -> reasons


def grid_points(grid: Grid, backend: str) -> Iterator[tuple[int, str, int | None, int]]:
    blocks = grid.block_sizes if BACKEND_LAYOUTS[backend] == "paged" else (None,)
    for head_dim in grid.head_dims:
        for dtype in grid.dtypes:
            for block_size in blocks:
                for gqa in grid.gqa_ratios:
                    yield head_dim, dtype, block_size, gqa


def cause_order(cause: str) -> int:
    return CAUSES.index(cause) if cause in CAUSES else len(CAUSES)


def causes_of(reasons: list[str]) -> list[str]:
    return sorted({reason_cause(r) for r in reasons}, key=cause_order)


def decide_rows(scenario: Scenario, backend: str, head_dim: int, dtype: str, block_size: int | None,
                gqa: int) -> list[Row]:
    layout = BACKEND_LAYOUTS[backend]
    spec = AttentionSpec(layout, scenario.device, dtype, head_dim, gqa * NUM_KV_HEADS, NUM_KV_HEADS,
                         block_size, scenario.compute_capability)
    decision = decide(spec, env=scenario.env)
    cc = scenario.compute_capability
    shared = {"scenario": scenario.name, "device": scenario.device,
              "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
              "packages": sorted(scenario.env.packages or ()), "backend": backend, "layout": layout,
              "head_dim": head_dim, "dtype": dtype, "block_size": block_size, "gqa_ratio": gqa,
              "num_q_heads": spec.num_q_heads, "num_kv_heads": NUM_KV_HEADS,
              "preferred": priority(scenario.device, layout)[0]}
    rows = []
    for phase, pd in decision.phases.items():
        reasons = {r.kernel: list(r.reasons) for r in pd.displaced}
        rows.append(Row(**shared, phase=phase, kernel=pd.kernel,
                        kernel_head_dim=kernel_head_dim(pd.kernel, head_dim), fallback=pd.is_fallback,
                        displaced=list(reasons), causes=causes_of([x for rs in reasons.values() for x in rs]),
                        reasons=reasons,
                        refused={r.kernel: list(r.reasons) for r in decision.refusals if r.phase == phase}))
    return rows


def run_grid(grid: Grid, scenarios: list[Scenario], progress: bool = False) -> list[Row]:
    jobs = [(s, b, *p) for s in scenarios for b in BACKEND_LAYOUTS for p in grid_points(grid, b)]
    if progress:
        from tqdm import tqdm
        jobs = tqdm(jobs, desc="deciding", unit="config", leave=False)
    return [row for job in jobs for row in decide_rows(*job)]


# -- summaries -----------------------------------------------------------------------------------------------
def row_key(row: Row) -> tuple:
    return (row.scenario, row.backend, row.phase, row.head_dim, row.dtype, row.block_size, row.gqa_ratio)


def kernel_counts(rows: list[Row]) -> dict[tuple[str, str, str], Counter]:
    counts: dict[tuple[str, str, str], Counter] = {}
    for r in rows:
        counts.setdefault((r.scenario, r.backend, r.phase), Counter())[r.kernel] += 1
    return counts


def cause_counts(rows: list[Row]) -> dict[tuple[str, str], Counter]:
    """Per scenario and backend: decisions, fallbacks, and fallbacks per rule family (a decision refused for
    two reasons counts under both)."""
    counts: dict[tuple[str, str], Counter] = {}
    for r in rows:
        c = counts.setdefault((r.scenario, r.backend), Counter())
        c["decisions"] += 1
        if r.fallback:
            c["fallbacks"] += 1
            c.update(r.causes)
    return counts


def fallback_paths(rows: list[Row]) -> Counter:
    """Distinct (scenario, backend, phase, chosen kernel, displaced kernels with causes) and how often."""
    paths: Counter = Counter()
    for r in rows:
        if r.fallback:
            displaced = tuple(f"{k} [{', '.join(causes_of(rs))}]" for k, rs in r.reasons.items())
            paths[(r.scenario, r.backend, r.phase, r.kernel, displaced)] += 1
    return paths


def gqa_sensitivity(rows: list[Row]) -> int:
    """How many (scenario, backend, phase, head_dim, dtype, block) points change kernel with the GQA ratio."""
    kernels: dict[tuple, set[str]] = {}
    for r in rows:
        kernels.setdefault(row_key(r)[:-1], set()).add(r.kernel)
    return sum(len(v) > 1 for v in kernels.values())


def describe(row: Row) -> str:
    pad = f" (computes with head_dim {row.kernel_head_dim})" if row.kernel_head_dim != row.head_dim else ""
    block = f", block {row.block_size}" if row.block_size is not None else ""
    text = (f"[{row.scenario}] {row.backend} {row.phase}, head_dim {row.head_dim}, {row.dtype}{block}, "
            f"GQA {row.gqa_ratio}: {row.kernel}{pad}")
    if row.displaced:
        text += "; displaced " + "; ".join(f"{k} ({', '.join(rs)})" for k, rs in row.reasons.items())
    return text


def at(scenario: str, backend: str, phase: str, head_dim: int, dtype: str, block: int | None) -> tuple:
    """A row key at GQA 4."""
    return (scenario, backend, phase, head_dim, dtype, block, 4)


# The example findings the study calls out, each looked up in the decided rows.
FINDINGS = [
    ("head_dim 80 on flash-attn paged kernels (page 256: padded to 96; page 16: refused; FlashInfer: no 80)",
     [at("cuda+fa+fi", "paged", "decode", 80, "bfloat16", 256),
      at("cuda+fa+fi", "paged", "decode", 80, "bfloat16", 16)]),
    ("an fp32 model",
     [at("cuda+fa+fi", "paged", "decode", 128, "float32", 256),
      at("cuda+fa+fi", "vmm", "decode", 128, "float32", None)]),
    ("block size 16 refused by upstream flash-attn's paged path",
     [at("cuda+fa+fi", "paged", "decode", 128, "bfloat16", 16)]),
    ("a missing package (this machine's packages on an H200)",
     [at("cuda", "paged", "decode", 128, "bfloat16", 256),
      at("cuda", "vmm", "decode", 128, "bfloat16", None)]),
    ("head_dim 100: decode and prefill get different kernels",
     [at("cuda+fa+fi", "paged", "decode", 100, "bfloat16", 256),
      at("cuda+fa+fi", "paged", "prefill", 100, "bfloat16", 256)]),
]


def findings(rows: list[Row]) -> list[tuple[str, list[str]]]:
    index = {row_key(r): r for r in rows}
    out = []
    for title, keys in FINDINGS:
        found = [describe(index[k]) for k in keys if k in index]
        if found:
            out.append((title, found))
    return out


def format_summary(rows: list[Row], scenarios: list[Scenario], grid: Grid) -> str:
    lines = [(f"kvlab fallbacks: {len(rows):,} decisions; head_dim {list(grid.head_dims)}, "
              f"dtype {list(grid.dtypes)}, block {list(grid.block_sizes)} (paged only), "
              f"GQA {list(grid.gqa_ratios)} (H_kv={NUM_KV_HEADS}); backends paged and vmm; "
              "prefill and decode"), ""]
    lines += ["Scenarios"] + [f"  {s.name:<11} {s.label}; packages {', '.join(sorted(s.env.packages or ()))}"
                              for s in scenarios] + [""]
    lines.append("Chosen kernel (number of decisions)")
    for (scen, backend, phase), c in kernel_counts(rows).items():
        kernels = ", ".join(f"{k} {n}" for k, n in c.most_common())
        lines.append(f"  {scen:<11} {backend:<6} {phase:<8} {kernels}")
    lines += ["", "Fallbacks by cause (a decision refused for several reasons counts under each)"]
    counts = cause_counts(rows)
    causes = [c for c in CAUSES if any(cc[c] for cc in counts.values())]
    header = ["scenario".ljust(11), "backend".ljust(7), "decisions", "fallbacks", *causes]
    lines.append("  " + " ".join(f"{h:>9}" for h in header))
    for (scen, backend), c in counts.items():
        cells = [scen.ljust(11), backend.ljust(7), c["decisions"], c["fallbacks"], *(c[x] for x in causes)]
        lines.append("  " + " ".join(f"{v:>{max(9, len(h))}}" for v, h in zip(cells, header, strict=True)))
    lines += ["", "Fallback paths (chosen <- displaced [causes]), most frequent first"]
    for (scen, backend, phase, kernel, displaced), n in fallback_paths(rows).most_common(12):
        lines.append(f"  {n:>5}  {scen:<11} {backend:<6} {phase:<8} {kernel} <- {'; '.join(displaced)}")
    lines += ["", f"The GQA ratio changed the kernel at {gqa_sensitivity(rows)} of the other grid points", ""]
    lines.append("Example findings")
    for title, found in findings(rows):
        lines.append(f"  * {title}")
        lines += [f"      {text}" for text in found]
    return "\n".join(lines)


# -- saving --------------------------------------------------------------------------------------------------
CSV_FIELDS = list(Row.__dataclass_fields__)


def csv_value(value: Any) -> Any:
    if isinstance(value, list):
        return ";".join(map(str, value))
    if isinstance(value, dict):
        return " | ".join(f"{k}: {', '.join(v)}" for k, v in value.items())
    return "" if value is None else value


def save(rows: list[Row], out: Path, summary: str, meta: dict[str, Any]) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "fallbacks.json", "csv": out / "fallbacks.csv", "summary": out / "summary.txt"}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: csv_value(v) for k, v in asdict(r).items()})
    paths["summary"].write_text(summary + "\n")
    return paths


def scenario_meta(s: Scenario) -> dict[str, Any]:
    return {"name": s.name, "label": s.label, "device": s.device, "compute_capability": s.compute_capability,
            "packages": sorted(s.env.packages or ()), "triton_interpret": s.env.interpreting_triton()}


# -- CLI -----------------------------------------------------------------------------------------------------
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
    p.add_argument("--no-plot", action="store_true", help="skip the heat-map PNG")
    p.add_argument("--measure", action="store_true",
                   help="also time the kernels that run on this machine (chosen vs displaced where both run)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per kernel (median reported)")
    p.set_defaults(run=run)
    return p


def check_grid(grid: Grid) -> None:
    lists = (grid.head_dims, grid.dtypes, grid.block_sizes, grid.gqa_ratios)
    sizes = grid.head_dims + grid.block_sizes + grid.gqa_ratios
    if not all(lists) or any(d not in DTYPES for d in grid.dtypes) or any(x < 1 for x in sizes):
        raise ConfigError(f"fallbacks grid: dtypes must be among {', '.join(DTYPES)}; head dims, block "
                          "sizes and GQA ratios non-empty lists of positive integers")


def run(args: argparse.Namespace) -> int:
    grid = Grid(tuple(args.head_dims), tuple(args.dtypes), tuple(args.block_sizes), tuple(args.gqa_ratios))
    check_grid(grid)
    if args.measure and (args.threads < 1 or args.repeats < 1):
        raise ConfigError("--threads and --repeats must be >= 1")
    scenarios = default_scenarios()
    out = Path(args.out or f"results/fallbacks-{time.strftime('%Y%m%d-%H%M%S')}")
    rows = run_grid(grid, scenarios, progress=True)
    summary = format_summary(rows, scenarios, grid)
    meta: dict[str, Any] = {"grid": asdict(grid), "num_kv_heads": NUM_KV_HEADS,
                            "scenarios": [scenario_meta(s) for s in scenarios]}
    if args.measure:
        from kvlab.experiments.fallback_timing import format_timings, measure
        meta["measure"] = measure(rows, threads=args.threads, repeats=args.repeats,
                                  grid_values={"block_sizes": grid.block_sizes, "head_dims": grid.head_dims})
        summary += "\n\n" + format_timings(meta["measure"])
    paths = save(rows, out, summary, meta)
    if not args.no_plot:
        from kvlab.experiments.fallback_plot import plot_heatmap
        paths["png"] = plot_heatmap(rows, out / "fallbacks.png")
    print(summary)
    print("\nSaved: " + ", ".join(str(p) for p in paths.values()))
    return 0
