"""Paired A/B: one `kvlab serve` subprocess per backend on a free loopback port, all up for the whole sweep, the
same arrivals and prompts at every rate, interleaved repeats per rate (as `kvlab bench` interleaves its rounds),
each server stopped with SIGTERM (exit 0 expected) at the end. cells.py turns the repeats into spreads and
verdicts."""
from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from kvlab.experiments.loadgen.load_run import LoadSpec, bench_once
from kvlab.experiments.loadgen.rows import SWEEP_ROW_KEYS
from kvlab.experiments.loadgen.sampler import StatsSampler
from kvlab.experiments.serve.process import launch, stop, wait_serving

log = logging.getLogger("kvlab.bench.serve")
START_TIMEOUT_S = 120


@contextlib.contextmanager
def kvlab_server(backend: str, model: str, extra: list[str]) -> Iterator[str]:
    """A `kvlab serve` subprocess (experiments/serve/process.py), its output in a temporary log; yields its base
    URL; always stopped (SIGTERM, then kill after a timeout)."""
    with tempfile.TemporaryDirectory(prefix="kvlab-serve-") as tmp:
        log_file = Path(tmp) / f"{backend}.log"
        proc = launch(["--model", model, "--backend", backend, *extra], log_file)
        try:
            yield wait_serving(proc, log_file, time.monotonic() + START_TIMEOUT_S)
        finally:
            stop(proc, f"{backend} server", log_file)


def server_counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else math.nan


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit in this process, so it unwinds through every server's teardown (no orphan); the
    previous handler is back afterwards. A forked child (a worker pool's) that inherits it dies as by default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def unwind(sig: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        raise SystemExit(128 + sig)
    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class SweepPlan(NamedTuple):
    backends: list[str]
    rates: list[float]
    repeats: int
    server_args: list[str]


def run_sweep(spec: LoadSpec, plan: SweepPlan, out_dir: str | None, argv: list[str], resume: str | None) -> int:
    """Every backend's server up at once; at each rate, `plan.repeats` rounds drive every backend in turn, in an
    order that reverses each round (so drift in the machine's load falls on both sides); `spec.model` is the
    kvlab preset served. Each finished run is kept as it finishes (reporting/checkpoint.py)."""
    from kvlab.experiments.reporting.checkpoint import Checkpoint, keeping
    from kvlab.experiments.reporting.provenance import jsonable
    out = Path(resume or out_dir or Path("results") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    config = jsonable({"load": spec, **plan._asdict()})
    checkpoint = Checkpoint(out, argv, config, len(plan.backends) * len(plan.rates) * plan.repeats,
                            resume=resume is not None)
    t0 = time.perf_counter()
    with keeping(checkpoint, "kvlab bench serve"), Servers(spec.model or "tiny", plan.server_args) as servers:
        rows = []
        for rate in plan.rates:
            runs = [run_cell(spec, servers, checkpoint, key, backend, rate, r)
                    for r in range(plan.repeats) for key, backend in round_order(plan, rate, r)]
            print_cells(runs)
            rows += runs
    sweep_s = time.perf_counter() - t0
    write(out, rows, sweep_s, spec, plan.backends, sweep_record(spec, plan.backends, plan.rates, plan.server_args))
    print(f"sweep: {len(plan.backends)} backends x {len(plan.rates)} rates x {plan.repeats} repeats in "
          f"{sweep_s:.1f} s ({checkpoint.resumed} run(s) from an earlier start); wrote {out}")
    return 0 if all(r["completed"] for r in rows) else 1


def round_order(plan: SweepPlan, rate: float, r: int) -> list[tuple[str, str]]:
    """Round r's (key, backend) pairs: the backends in order on even rounds, reversed on odd ones."""
    order = plan.backends if r % 2 == 0 else plan.backends[::-1]
    return [(f"{b} rate {rate:g} repeat {r}", b) for b in order]


class Servers:
    """One `kvlab serve` per backend, started when first needed (a resumed sweep that holds every run of a
    backend never starts it) and all stopped on exit."""

    def __init__(self, model: str, server_args: list[str]) -> None:
        self.model, self.server_args = model, server_args
        self.urls: dict[str, str] = {}
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

    def url(self, backend: str) -> str:
        if backend not in self.urls:
            self.urls[backend] = self.stack.enter_context(kvlab_server(backend, self.model, self.server_args))
        return self.urls[backend]


def print_cells(runs: list[dict[str, Any]]) -> None:
    """One rate's cells: each backend's median [min-max], then the verdicts against the first backend."""
    from kvlab.experiments.loadgen.cells import cell_line, cells_of
    for cell in cells_of(runs):
        print(cell_line(cell), flush=True)
        for line in cell.get("verdicts", []):
            print(f"  {line}", flush=True)


def run_cell(spec: LoadSpec, servers: Servers, checkpoint: Any, key: str, backend: str, rate: float,
             repeat: int) -> dict[str, Any]:
    """One run of one backend at one rate (or the one a checkpoint holds); its summary line, and the cell's
    spread and verdicts once the rate's last round is done."""
    if key in checkpoint:
        return checkpoint.get(key)
    url = servers.url(backend)
    before = server_counter(url, "kvlab_preemptions_total")
    with StatsSampler(url) as sampler:
        row = bench_once(spec, url, rate) | {"backend": backend, "repeat": repeat}
    row["timeline"] = sampler.series
    row["timeline_poll_errors"] = sampler.errors
    row["server_preemptions"] = server_counter(url, "kvlab_preemptions_total") - before
    checkpoint.record(key, row)
    print(f"{backend:8} rate {rate:>6g} #{repeat}: {row['completed']} done, p99 TTFT {row['p99_ttft_ms']:.1f} ms, "
          f"p99 TPOT {row['p99_tpot_ms']:.2f} ms, {row['output_throughput']:.0f} tok/s", flush=True)
    warning = overload_line(rate, row.get("request_throughput"))
    if warning:
        print(f"{backend:8} rate {rate:>6g}: {warning}", flush=True)
    return row


OVERLOADED = 0.5        # achieved / offered request rate below which the server could not keep up


def overload_line(offered: float, achieved: float | None) -> str | None:
    """Said when the server completed requests far slower than they were offered: its latencies then measure a
    queue that grew for the whole run, not the server at that rate."""
    if achieved is None or math.isinf(offered) or achieved >= OVERLOADED * offered:
        return None
    return (f"overloaded: {achieved:.3g} req/s achieved of {offered:g} offered; the queue grew all run, so the "
            "latencies measure the queue (lower the rate or the prompt lengths)")


def sweep_record(spec: LoadSpec, backends: list[str], rates: list[float], server_args: list[str]) -> dict[str, Any]:
    """The provenance of a sweep: the load, the rates, the server arguments and each server's engine config."""
    from kvlab.experiments.reporting.provenance import provenance, served_config
    model = spec.model or "tiny"
    servers = {b: served_config(["--model", model, "--backend", b, *server_args]) for b in backends}
    return provenance({"command": "bench serve", "load": spec, "request_rates": rates, "server_args": server_args,
                       "engine": servers})


def write(out: Path, rows: list[dict[str, Any]], sweep_s: float, spec: LoadSpec, backends: list[str],
          record: dict[str, Any]) -> None:
    from kvlab.experiments.reporting.provenance import jsonable, write_provenance
    write_provenance(out, record)
    meta = {"sweep_seconds": sweep_s, "backends": backends, "repeats": 1 + max(r.get("repeat", 0) for r in rows),
            "num_prompts": spec.num_prompts,
            "dataset": spec.dataset, "burstiness": spec.burstiness, "seed": spec.seed,
            "goodput": list(spec.goodput) if spec.goodput is not None else None}
    from kvlab.experiments.loadgen.cells import cells_of
    cells = cells_of(rows)
    (out / "serve.json").write_text(json.dumps(jsonable({"provenance": record, "meta": meta, "cells": cells,
                                                         "runs": rows}), indent=1))
    with open(out / "serve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWEEP_ROW_KEYS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    log_rows = [{"backend": r["backend"], "request_rate": r["request_rate"], "repeat": r.get("repeat", 0)} | q
                for r in rows for q in r.get("requests", [])]
    if log_rows:
        with open(out / "serve_requests.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(log_rows[0]))
            w.writeheader()
            w.writerows(log_rows)
    from kvlab.experiments.loadgen.report import write_report
    write_report(out, rows, meta, record)
