"""`python -m kvlab.experiments.bench.perf [--out DIR] [--threads N] [--repeats N] [--only a,b] [--quick]`.

Runs each benchmark family in this process at one fixed torch thread count, prints one table (value, goal,
met/MISSED) and writes DIR/perf.json (default results/perf-<timestamp>/). A family that fails is reported with
its error and the others still run; the exit code is 1 if any failed.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from datetime import datetime
from pathlib import Path

FAMILIES = {
    "throughput": "kvlab.experiments.bench.perf.throughput",
    "attention": "kvlab.experiments.bench.perf.attention",
    "end_to_end": "kvlab.experiments.bench.perf.end_to_end",
    "allocator": "kvlab.experiments.bench.perf.allocator",
    "simulator": "kvlab.experiments.bench.perf.simulator",
    "serving": "kvlab.experiments.bench.perf.serving",
    "roofline": "kvlab.experiments.bench.perf.roofline",
    "hf_cb": "kvlab.experiments.bench.perf.hf_cb",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvlab.experiments.bench.perf", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", help="results directory (default results/perf-<timestamp>); a path "
                                                "ending in .json names the file itself")
    p.add_argument("--threads", type=int, default=1, help="torch threads for every measurement (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (medians, p90)")
    p.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of: {', '.join(FAMILIES)}")
    p.add_argument("--quick", action="store_true", help="smallest sizes (a smoke run, not a measurement)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in args.only if f not in FAMILIES]
    if unknown:
        p.error(f"unknown benchmark family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    if args.threads < 1 or args.repeats < 1:
        p.error("--threads and --repeats must be >= 1")
    return args


def output_path(out: str | None) -> Path:
    if out and out.endswith(".json"):
        return Path(out)
    directory = Path(out) if out else Path("results") / f"perf-{datetime.now():%Y%m%d-%H%M%S}"
    return directory / "perf.json"


def run_families(names: list[str], settings, threads: int) -> tuple[list, dict[str, str], dict[str, dict]]:
    """Each family in turn -> (result rows, errors by family, wall seconds and CPU share by family)."""
    import torch
    results, errors, timing = [], {}, {}
    for family in names:
        t0, c0 = time.perf_counter(), time.process_time()
        print(f"[{family}] running ...", file=sys.stderr, flush=True)
        try:
            results += importlib.import_module(FAMILIES[family]).run(settings)
        except Exception as exc:  # noqa: BLE001 - one broken family must not lose the others' numbers
            errors[family] = f"{type(exc).__name__}: {exc}"
            print(f"[{family}] FAILED: {errors[family]}", file=sys.stderr, flush=True)
        torch.set_num_threads(threads)   # a family may not change it for the next one
        wall = time.perf_counter() - t0
        # this process's CPU time over wall time: well below the thread count means others took the cores
        timing[family] = {"seconds": round(wall, 2), "cpu_share": round((time.process_time() - c0) / wall, 2)}
    return results, errors, timing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():   # Triton runs only in its interpreter here; set before any @triton.jit
        os.environ.setdefault("TRITON_INTERPRET", "1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    torch.set_num_threads(args.threads)
    from kvlab.experiments.bench.perf.harness import Settings, machine_info
    from kvlab.experiments.bench.perf.report import table, write_json
    settings = Settings(threads=args.threads, repeats=args.repeats, quick=args.quick, seed=args.seed)
    machine = machine_info()
    results, errors, timing = run_families(args.only, settings, args.threads)
    if settings.quick:   # smoke sizes measure nothing worth holding to a goal
        for r in results:
            r.goal = None
        print("quick mode: smallest sizes, goals not evaluated", file=sys.stderr)
    print(table(results))
    machine["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    share = {family: t["cpu_share"] for family, t in timing.items()}
    print(f"\n{args.threads} torch thread(s), medians of {args.repeats} repeats; machine: {machine['cpu']} "
          f"({machine['logical_cpus']} logical CPUs), load average at start {machine['load_average_at_start']}, at "
          f"end {machine['load_average_at_end']}; CPU time / wall time per family: {share}")
    path = output_path(args.out)
    write_json(path, machine, {**vars(args), "families": timing}, results, errors)
    print(f"results written to {path}")
    for family, error in errors.items():
        print(f"{family}: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
