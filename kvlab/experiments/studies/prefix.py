"""`kvlab prefix`: prefix-cache hit rate and savings against the unit size, paged blocks vs vmm pages.

Each setting (a backend and its unit) runs one prefix-structured workload (experiments/workloads/prefix.py)
twice, prefix caching on and off, and reports:
- hit rate: prompt tokens served from the cache / prompt tokens;
- prefill tokens saved: tokens the model did not compute (off - on);
- KV bytes saved: the hit tokens' K/V, not written again (hit tokens x bytes per token);
- throughput (total tokens/s) and TTFT (p50), on and off;
- granularity loss: prompt tokens an unbounded token-granular cache would have served (longest common prefix
  with an earlier prompt) that no cache of this unit can serve, because they are not a whole unit; and the
  missed tokens: whole-unit shareable tokens this run did not hit (evicted, or admitted in the same step as
  the prompt it shares with, before that one was computed).

Two runs: `real` (the engine and the tiny model on CPU, small units: vmm pages of 4 KiB and up) and `sim` (the
simulator at GPU scale, Llama-3-8B on an H100 roofline with prefill modelled; paged blocks 16/32/128 and vmm
pages from one 16-token block's bytes (32 KiB) up to 2 MiB). Output: rows.json, rows.csv, report.txt and
prefix.png (hit rate and throughput against tokens per unit) in results/<timestamp>/.
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.kv.options import check_choice
from kvlab.common.limits import check_seed
from kvlab.common.machine import check_fits_in_ram
from kvlab.common.validate import check_number, check_output_path
from kvlab.experiments.cli import flags as cli
from kvlab.experiments.limits import MAX_BUDGET_GB
from kvlab.experiments.reporting.provenance import provenance, write_provenance
from kvlab.experiments.reporting.tables import results_dir
from kvlab.experiments.workloads import prefix as pw

KiB, MiB = 1024, 1024 ** 2
RUNS = ("real", "sim")
WORKLOADS = ("system", "multiturn", "fewshot", "trace")
SIM_BOOK_BYTES_PER_GB = 500_000    # measured: peak RSS 0.28 GB at --budget-gb 8, 0.71 at 800, 1.09 at 1,600
SIM_UNITS = [("paged", 16), ("paged", 32), ("paged", 128),
             ("vmm", 32 * KiB), ("vmm", 64 * KiB), ("vmm", 256 * KiB), ("vmm", 2 * MiB)]
REAL_UNITS = [("paged", 8), ("paged", 16), ("paged", 32), ("paged", 128),
              ("vmm", 4 * KiB), ("vmm", 8 * KiB), ("vmm", 16 * KiB), ("vmm", 64 * KiB)]


@dataclass(slots=True)
class PrefixRow:
    run: str                       # real | sim
    workload: str
    backend: str
    unit: str                      # "16 tok" blocks, "64KiB" pages
    tokens_per_unit: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    shareable_tokens: int          # what a token-granular unbounded cache would hit
    granularity_loss: int          # shareable tokens that are not a whole unit (no cache of this unit hits them)
    missed_tokens: int             # whole-unit shareable tokens not hit (evicted, or the twin was still computing)
    prefill_saved: int             # computed tokens, off - on
    kv_bytes_saved: int
    throughput_on: float           # total tokens/s
    throughput_off: float
    ttft_p50_on: float
    ttft_p50_off: float
    preemptions_on: int
    evictions: int


# -- workloads -------------------------------------------------------------------------------------------------
def sim_workload(name: str, vocab: int, seed: int) -> list[pw.PrefixRequest]:
    if name == "system":
        return pw.system_prompts(96, k=4, system_len=2000, tail_len=200, output_len=128, vocab_size=vocab,
                                 seed=seed, interval_s=0.02)
    if name == "multiturn":
        return pw.multi_turn(24, turns=4, system_len=500, user_len=200, answer_len=200, think_s=2.0,
                             vocab_size=vocab, seed=seed)
    if name == "fewshot":
        return pw.few_shot(64, preamble_len=1500, tail_len=100, output_len=64, vocab_size=vocab, seed=seed,
                           interval_s=0.02)
    if name == "trace":
        return pw.load_mooncake(pw.SAMPLE_TRACE, block_size=16, vocab_size=vocab, seed=seed)
    raise ConfigError(f"unknown prefix workload {name!r}; choose system, multiturn, fewshot or trace")


def real_workload(name: str, vocab: int, seed: int) -> list[pw.PrefixRequest]:
    if name == "system":
        return pw.system_prompts(16, k=2, system_len=96, tail_len=12, output_len=8, vocab_size=vocab, seed=seed)
    if name == "multiturn":
        return pw.multi_turn(4, turns=3, system_len=32, user_len=16, answer_len=8, vocab_size=vocab, seed=seed)
    if name == "fewshot":
        return pw.few_shot(12, preamble_len=96, tail_len=12, output_len=8, vocab_size=vocab, seed=seed)
    if name == "trace":
        return pw.load_mooncake(pw.SAMPLE_TRACE, block_size=16, vocab_size=vocab, seed=seed)
    raise ConfigError(f"unknown prefix workload {name!r}; choose system, multiturn, fewshot or trace")


def unit_label(backend: str, unit: int) -> str:
    if backend == "paged":
        return f"{unit} tok"
    return f"{unit // MiB}MiB" if unit % MiB == 0 else f"{unit // KiB}KiB"


def unit_options(backend: str, unit: int) -> dict[str, int]:
    return {"block_size": unit} if backend == "paged" else {"page_size": unit}


# -- the simulator ---------------------------------------------------------------------------------------------
def sim_rows(workload: str, budget_gb: float, seed: int, units: list[tuple[str, int]]) -> list[PrefixRow]:
    from kvlab.experiments.sim.core import SimCase, SimSettings, simulate
    from kvlab.experiments.workloads.requests import WorkloadSpec
    reqs = sim_workload(workload, 32000, seed)
    sim_reqs = pw.as_sim_requests(reqs)
    shareable = pw.shareable_per_request(reqs)
    rows = []
    for backend, unit in units:
        case = SimCase(backend, budget_gb, **{("block_size" if backend == "paged" else "page_size"): unit})
        runs = {}
        for on in (True, False):
            settings = SimSettings(WorkloadSpec(num_requests=len(reqs), seed=seed), model_prefill=True,
                                   engine={"enable_prefix_caching": on, "max_num_batched_tokens": 8192,
                                           "max_num_seqs": 64})
            runs[on] = simulate(case, settings, sim_reqs)
        rows.append(make_row("sim", workload, backend, unit, runs[True].metrics, runs[False].metrics,
                             runs[True].cache_stats, shareable))
    return rows


def make_row(run: str, workload: str, backend: str, unit: int, on: Any, off: Any, stats: Any,
             shareable: list[int]) -> PrefixRow:
    hit, tpu = stats.prefix_hit_tokens, stats.tokens_per_unit
    bytes_per_token = _bytes_per_token(stats)
    loss = pw.granularity_loss(shareable, tpu)
    return PrefixRow(
        run=run, workload=workload, backend=backend, unit=unit_label(backend, unit),
        tokens_per_unit=tpu, prompt_tokens=on.prompt_tokens, hit_tokens=hit,
        hit_rate=hit / on.prompt_tokens if on.prompt_tokens else 0.0, shareable_tokens=sum(shareable),
        granularity_loss=loss, missed_tokens=sum(shareable) - loss - hit,
        prefill_saved=off.computed_tokens - on.computed_tokens,
        kv_bytes_saved=hit * bytes_per_token, throughput_on=on.total_tokens_per_s,
        throughput_off=off.total_tokens_per_s, ttft_p50_on=on.ttft_p50 or 0.0, ttft_p50_off=off.ttft_p50 or 0.0,
        preemptions_on=on.preemptions,
        evictions=int(stats.extra.get("prefix_evictions", 0)))


def _bytes_per_token(stats: Any) -> int:
    if stats.backend == "paged":
        return stats.extra["block_bytes"] // stats.tokens_per_unit
    tensors = stats.extra["pool_pages"] // stats.total_units   # 2L page-sized tensors per group
    return tensors * stats.extra["page_size"] // stats.tokens_per_unit


# -- the real engine -------------------------------------------------------------------------------------------
def real_rows(workload: str, seed: int, units: list[tuple[str, int]]) -> list[PrefixRow]:
    from kvlab.common.loader import load_model
    model, _ = load_model("tiny", "float32", "cpu", 0)
    reqs = real_workload(workload, model.config.vocab_size, seed)
    shareable = pw.shareable_per_request(reqs)
    rows = []
    for backend, unit in units:
        runs = {on: run_real(backend, unit, reqs, on) for on in (True, False)}
        rows.append(make_row("real", workload, backend, unit, runs[True][0], runs[False][0], runs[True][1],
                             shareable))
    return rows


def run_real(backend: str, unit: int, reqs: list[pw.PrefixRequest], prefix: bool) -> tuple[Any, Any]:
    """The requests through the tiny model, one added per engine step in arrival order (so a prompt arrives
    after its predecessors started computing, as under load)."""
    from kvlab.common.llm import LLM
    from kvlab.common.sampling_params import SamplingParams
    longest = max(len(r.token_ids) + r.output_len for r in reqs)
    with LLM("tiny", backend=backend, enable_prefix_caching=prefix, threads=1, max_num_seqs=8,
             max_model_len=-(-longest // 128) * 128, kv_cache_bytes=8 * MiB, **unit_options(backend, unit)) as llm:
        engine = llm.engine
        engine.reset_metrics()
        pending = sorted(reqs, key=lambda r: r.arrival_s)
        for r in pending:
            engine.add_request(r.token_ids, SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
            engine.step()
        while engine.has_unfinished():
            engine.step()
        return engine.metrics(), engine.cache_stats()


# -- CLI ---------------------------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("prefix", help="prefix-cache hit rate and savings vs unit size, paged vs vmm",
                              description="Prefix caching on paged and vmm: hit rate, prefill and KV saved, "
                                          "throughput, TTFT and granularity loss against the unit size.")
    p.add_argument("--runs", type=cli.parse_list, default=["real", "sim"], help="real (tiny model, CPU), sim")
    p.add_argument("--workloads", type=cli.parse_list, default=["system", "multiturn"],
                   help="system, multiturn, fewshot, trace (the sample Mooncake-schema trace)")
    p.add_argument("--budget-gb", type=float, default=8.0, help="simulated KV budget (GB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer unit sizes (for a smoke test)")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>/)")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    p.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> None:
    """Every value through the validation layer before any model, simulation or output (run() then checks --out):
    a bad one is one line and exit 2 with nothing on stdout, never a traceback or results that cannot be saved."""
    for r in args.runs:
        check_choice("--runs entry", r, RUNS)
    for w in args.workloads:
        check_choice("--workloads entry", w, WORKLOADS)
    check_number("--budget-gb", args.budget_gb, 0.0, MAX_BUDGET_GB, strict=True)
    check_seed("--seed", args.seed)
    if "sim" in args.runs:
        check_sim_books(args.budget_gb)


def check_sim_books(budget_gb: float) -> None:
    """The simulated caches hold no KV, only books per block and page: SIM_BOOK_BYTES_PER_GB over the budget
    must fit in this machine's RAM (1e5 GB would take ~50 GB)."""
    check_fits_in_ram(f"--budget-gb {budget_gb:g} (the simulator's books for its smallest blocks and pages)",
                      budget_gb * SIM_BOOK_BYTES_PER_GB, "lower --budget-gb")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    out = None if args.no_save else check_output_path("--out", results_dir(args.out), directory=True)
    rows: list[PrefixRow] = []
    start = time.perf_counter()
    for workload in args.workloads:
        if "sim" in args.runs:
            units = [SIM_UNITS[0], SIM_UNITS[3], SIM_UNITS[6]] if args.quick else SIM_UNITS
            rows += sim_rows(workload, args.budget_gb, args.seed, units)
        if "real" in args.runs:
            units = [REAL_UNITS[1], REAL_UNITS[4]] if args.quick else REAL_UNITS
            rows += real_rows(workload, args.seed, units)
    text = report(rows) + f"\n({time.perf_counter() - start:.0f} s)"
    print(text)
    if out is not None:
        save(rows, text, out, provenance(run_config(args)))
    return 0


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The resolved configuration: the runs, workloads, budget, seed and the unit sizes measured."""
    pick = lambda units, quick: [units[i] for i in quick] if args.quick else units
    return {"command": "prefix", "runs": args.runs, "workloads": args.workloads, "budget_gb": args.budget_gb,
            "seed": args.seed, "quick": args.quick, "real_model": "tiny (float32, cpu)",
            "sim_units": pick(SIM_UNITS, (0, 3, 6)), "real_units": pick(REAL_UNITS, (1, 4))}


def report(rows: list[PrefixRow]) -> str:
    head = (f"{'run':4} {'workload':9} {'backend':7} {'unit':>8} {'tok/u':>5} {'hit rate':>8} {'prefill saved':>13} "
            f"{'KV saved':>10} {'gran. loss':>10} {'missed':>7} {'tok/s on/off':>19} {'TTFT p50 on/off (ms)':>21}")
    lines = ["prefix caching: hits and savings against the unit size", head]
    for r in rows:
        lines.append(f"{r.run:4} {r.workload:9} {r.backend:7} {r.unit:>8} {r.tokens_per_unit:>5} {r.hit_rate:>8.1%} "
                     f"{r.prefill_saved:>13,} {r.kv_bytes_saved / MiB:>8.1f}Mi {r.granularity_loss:>10,} "
                     f"{r.missed_tokens:>7,} "
                     f"{r.throughput_on:>9.0f}/{r.throughput_off:<9.0f} "
                     f"{r.ttft_p50_on * 1e3:>10.1f}/{r.ttft_p50_off * 1e3:<10.1f}")
    return "\n".join(lines)


def save(rows: list[PrefixRow], text: str, out: Path, record: dict[str, Any]) -> None:
    write_provenance(out, record)
    (out / "rows.json").write_text(json.dumps({"provenance": record, "rows": [asdict(r) for r in rows]}, indent=1))
    with open(out / "rows.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, [CSV_NAMES.get(fl.name, (fl.name,))[0] for fl in fields(PrefixRow)])
        writer.writeheader()
        writer.writerows(csv_row(r) for r in rows)
    (out / "report.txt").write_text(text + "\n")
    plot(rows, out / "prefix.png")
    print(f"results in {out}/ (provenance.json, rows.json, rows.csv, report.txt, prefix.png)")


# rows.csv names every timed column with its unit: field -> (column, factor)
CSV_NAMES = {"throughput_on": ("throughput_on_tokens_per_s", 1), "throughput_off": ("throughput_off_tokens_per_s", 1),
             "ttft_p50_on": ("ttft_p50_on_ms", 1000), "ttft_p50_off": ("ttft_p50_off_ms", 1000)}


def csv_row(row: PrefixRow) -> dict[str, Any]:
    out = {}
    for key, value in asdict(row).items():
        name, factor = CSV_NAMES.get(key, (key, 1))
        out[name] = value * factor
    return out


def plot(rows: list[PrefixRow], path: Path) -> None:
    """Per run (real, sim): hit rate and throughput gain (cache on / off) against tokens per unit; one colour per
    workload, solid paged, dashed vmm (the two coincide where their units hold the same tokens)."""
    from kvlab.experiments.reporting.plots import _pyplot
    plt = _pyplot()
    runs = [r for r in ("real", "sim") if any(row.run == r for row in rows)]
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    workloads = sorted({r.workload for r in rows})
    colours = dict(zip(workloads, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (ax_hit, ax_tp), run in zip(axes, runs):
        for workload in workloads:
            for backend, style, width in (("paged", "-o", 2.5), ("vmm", "--s", 1.2)):
                sel = sorted((r for r in rows if (r.run, r.workload, r.backend) == (run, workload, backend)),
                             key=lambda r: r.tokens_per_unit)
                if not sel:
                    continue
                x, label = [r.tokens_per_unit for r in sel], f"{workload} {backend}"
                kw = {"color": colours[workload], "linewidth": width, "markersize": 4, "label": label}
                ax_hit.plot(x, [r.hit_rate for r in sel], style, **kw)
                ax_tp.plot(x, [r.throughput_on / r.throughput_off if r.throughput_off else 0 for r in sel], style,
                           **kw)
        for ax, ylabel in ((ax_hit, "prefix hit rate"), (ax_tp, "throughput, cache on / off")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per unit (paged block, vmm page)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{run}: " + ("tiny model, CPU" if run == "real" else "llama3-8b, h100 roofline"),
                         fontsize=9)
            ax.grid(alpha=0.3)
        ax_hit.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
