"""`kvlab sharing`: KV memory saved by sharing (fork + copy-on-write) for parallel sampling and beam search.

Each configuration runs a workload through the real engine and model. After every step the backend reports
the units it holds (shared units counted once); without sharing every live sequence would hold
ceil(tokens / tokens_per_unit) units of its own. Saving = 1 - sum(held) / sum(unshared) over the run, the
time-averaged block saving Kwon et al. report (6.1-9.8% parallel sampling, 37.6-55.2% beam search on Alpaca).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.bench.units import fair_unit_defaults, rank_shape
from kvlab.experiments.cli import flags
from kvlab.experiments.reporting.provenance import engine_config, provenance, write_provenance
from kvlab.experiments.reporting.tables import changes_line, progress_bar, results_dir, threads_label
from kvlab.experiments.workloads.requests import WorkloadSpec, build_workload, parse_workload, prompt_token_ids

ARTICLE = {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)}
# Alpaca's mean lengths (Kwon et al., Table 1: 19.31 in, 58.45 out), as uniform ranges around them
ALPACA_LIKE = "uniform:10-30:30-90"
WIDTHS = tuple(range(2, 9))
MAX_WIDTH = 64


@dataclass(slots=True)
class SharingRow:
    backend: str
    mode: str                 # parallel | beam
    width: int
    saved: float              # fraction of unshared KV units saved
    held_units: int           # summed over steps
    unshared_units: int
    cow_copies: int
    output_tokens: int
    steps: int


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("sharing", help="KV memory saved by sharing: parallel sampling and beam search",
                              description="Measure KV memory saved by fork/copy-on-write on paged and vmm.")
    p.add_argument("--backends", type=flags.parse_list, default=["paged", "vmm"])
    p.add_argument("--modes", type=flags.parse_list, default=["parallel", "beam"])
    p.add_argument("--widths", type=flags.parse_list, default=[str(w) for w in WIDTHS], help="n / beam widths")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--workload", type=flags.arg_type(parse_workload), default=parse_workload(ALPACA_LIKE),
                   help=f"default {ALPACA_LIKE} (Alpaca-like); seed | fixed:P:O | uniform:PLO-PHI:OLO-OHI | "
                        "trace:FILE.jsonl")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>/): "
                                                   "provenance.json, rows.json, report.txt")
    p.add_argument("--json", metavar="PATH",
                   help='write {"provenance": {...}, "rows": [...]} to PATH only (no results directory)')
    p.add_argument("--no-progress", action="store_true")
    flags.add_engine_flags(p, skip=("backend",))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvlab.common.loader import load_model
    widths = parse_widths(args.widths)
    flags.check_output_path(args.json, "--json")
    flags.check_output_path(args.out, "--out", directory=True)
    for mode in args.modes:
        if mode not in ARTICLE:
            raise ConfigError(f"unknown sharing mode {mode!r}; choose parallel or beam")
    spec = dataclasses.replace(args.workload, num_requests=args.num_requests, scale=args.scale,
                               seed=args.seed if args.seed is not None else 0)
    requests = build_workload(spec)
    engine_flags = vars(args)
    probe, *_ = [flags.engine_config(engine_flags, backend=b) for b in args.backends]   # all checked up front
    print(changes_line(spec, scale_given=args.scale != 1.0))
    if probe.threads:
        torch.set_num_threads(probe.threads)
    print(f"kvlab sharing: model {probe.model} ({probe.dtype}, {probe.device}, {threads_label(probe.threads)})")
    model, _ = load_model(probe.model, probe.dtype, probe.device, probe.seed)
    jobs = [(b, m, w) for b in args.backends for m in args.modes for w in widths]
    rows = measure_all(jobs, engine_flags, model, requests, spec.seed, not args.no_progress)
    text = report(rows, spec, probe.model)
    print(text)
    save(rows, text, args.out, args.json, provenance(run_config(args, spec, model, requests, widths)))
    return 0


def run_config(args: argparse.Namespace, spec: WorkloadSpec, model: Any, requests: list,
               widths: list[int]) -> dict[str, Any]:
    """The resolved configuration: the workload and each (backend, width)'s engine config as run."""
    engine = {f"{b} width {w}": engine_config(sharing_config(vars(args), b, model, requests, w))
              for b in args.backends for w in widths}
    return {"command": "sharing", "backends": args.backends, "modes": args.modes, "widths": widths,
            "workload": spec, "engine": engine}


def measure_all(jobs: list[tuple[str, str, int]], engine_flags: dict[str, Any], model: Any, requests: list,
                seed: int, progress: bool) -> list[SharingRow]:
    """One row per (backend, mode, width), each on a fresh engine over the same prompts."""
    prompts = prompt_token_ids(requests, model.config.vocab_size, seed)
    outputs = [r.output_len for r in requests]
    rows = []
    bar = progress_bar(total=len(jobs), desc="sharing", unit="run") if progress else None
    for backend, mode, width in jobs:
        config = sharing_config(engine_flags, backend, model, requests, width)
        rows.append(measure(config, model, prompts, outputs, mode, width))
        if bar is not None:
            bar.set_postfix_str(f"{backend} {mode} {width}")
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def save(rows: list[SharingRow], text: str, out_dir: str | None, json_path: str | None,
         record: dict[str, Any]) -> None:
    """--json PATH alone, else provenance.json, rows.json and report.txt in --out or results/<timestamp>/."""
    payload = json.dumps({"provenance": record, "rows": [asdict(r) for r in rows]}, indent=1)
    if json_path and not out_dir:
        Path(json_path).write_text(payload)
        print(f"rows written to {json_path}")
        return
    out = results_dir(out_dir)
    write_provenance(out, record)
    (out / "rows.json").write_text(payload)
    (out / "report.txt").write_text(text + "\n")
    if json_path:
        Path(json_path).write_text(payload)
    print(f"results in {out}/ (provenance.json, rows.json, report.txt)")


def parse_widths(values: list[str]) -> list[int]:
    try:
        widths = [int(v) for v in values]
    except ValueError:
        raise ConfigError(f"--widths must be integers, got {','.join(values)}") from None
    if any(w < 2 for w in widths):
        raise ConfigError("--widths must all be >= 2 (1 shares nothing)")
    if any(w > MAX_WIDTH for w in widths):
        raise ConfigError(f"--widths must all be <= {MAX_WIDTH} (beam search costs grow with width squared), "
                          f"got {max(widths)}")
    return widths


def sharing_config(engine_flags: dict[str, Any], backend: str, model: Any, requests: list, width: int):
    """Room for every sequence at full length (no preemption: this measures sharing, not pressure); every
    backend's unit holds the same tokens (bench/units.py) unless --block-size or --page-size is given.
    `engine_flags`: the engine flags as given (None: not given)."""
    longest = max(r.total_len for r in requests)
    probe = flags.engine_config(engine_flags, backend=backend)
    shape = model.kv_shape(probe.dtype, probe.device)
    units = fair_unit_defaults(probe, rank_shape(shape, probe).bytes_per_token_per_layer)
    block = engine_flags.get("block_size") or units["block_size"]
    seqs = len(requests) * width * (2 if backend == "vmm" else 1)   # beam search keeps 2x candidates briefly
    defaults = {"max_model_len": longest, "max_num_seqs": seqs, "max_num_batched_tokens": max(2048, seqs),
                "watermark": 0.0, "kv_cache_bytes": 2 * seqs * (longest + block) * shape.bytes_per_token, **units}
    given = {k for k in flags.engine_flag_names() if engine_flags.get(k) is not None}
    return flags.engine_config(engine_flags, backend=backend, **{k: v for k, v in defaults.items() if k not in given})


def measure(config: Any, model: Any, prompts: list[list[int]], outputs: list[int], mode: str,
            width: int) -> SharingRow:
    from kvlab.common.engine import Engine
    from kvlab.common.sampling_params import SamplingParams
    engine = Engine.from_model(config, model)
    held = unshared = steps = 0
    try:
        for prompt, out_len in zip(prompts, outputs):
            params = (SamplingParams(n=width, temperature=1.0, seed=len(prompt), max_tokens=out_len, ignore_eos=True)
                      if mode == "parallel" else
                      SamplingParams(beam_width=width, n=1, temperature=0.0, max_tokens=out_len, ignore_eos=True))
            engine.add_request(prompt, params)
        engine.reset_metrics()
        cache = engine.cache
        while engine.has_unfinished():
            engine.step()
            s = cache.stats()
            tpu = s.tokens_per_unit
            alone = sum(-(-q.num_computed_tokens // tpu) for q in engine.running_sequences()
                        if cache.allocator.holds(q))
            if alone:
                held += s.used_units
                unshared += alone
                steps += 1
        m = engine.metrics()
        cow = cache.stats().cow_copies
    finally:
        engine.close()
    if m.num_failed:
        raise ConfigError(f"{m.num_failed} {mode} requests failed on {config.backend}: raise --kv-cache-bytes")
    return SharingRow(config.backend, mode, width, 1 - held / unshared if unshared else 0.0, held, unshared, cow,
                      m.output_tokens, steps)


def report(rows: list[SharingRow], spec: WorkloadSpec, model: str) -> str:
    from kvlab.experiments.reporting.tables import table
    backends = list(dict.fromkeys(r.backend for r in rows))
    lines = []
    for mode in dict.fromkeys(r.mode for r in rows):
        lo, hi = ARTICLE[mode]
        widths = sorted({r.width for r in rows if r.mode == mode})
        body = [[str(w), *(f"{100 * _row(rows, b, mode, w).saved:.1f}%" for b in backends)] for w in widths]
        name = "parallel sampling n" if mode == "parallel" else "beam width"
        lines.append(table([name, *(f"{b} saved" for b in backends)], body,
                           f"KV memory saved by sharing, {mode} ({model}, {spec.num_requests} requests, "
                           f"{spec.kind} lengths x{spec.scale:g}); Kwon et al. on Alpaca: "
                           f"{100 * lo:.1f}-{100 * hi:.1f}%"))
        lines.append("")
    return "\n".join(lines).rstrip()


def _row(rows: list[SharingRow], backend: str, mode: str, width: int) -> SharingRow:
    return next(r for r in rows if r.backend == backend and r.mode == mode and r.width == width)
