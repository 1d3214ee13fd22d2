"""Paired A/B: one `kvlab serve` subprocess per backend on a free loopback port, the same arrivals and prompts
at every rate, stopped with SIGTERM (exit 0 expected) before the next backend starts."""
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
from typing import Any

import httpx

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen.load_run import LoadSpec, bench_once
from kvlab.experiments.loadgen.sampler import StatsSampler
from kvlab.experiments.serve.process import launch, stop, wait_serving

log = logging.getLogger("kvlab.bench.serve")
START_TIMEOUT_S = 120
ROW_KEYS = ("backend", "request_rate", "completed", "failed", "duration", "request_throughput",
            "output_throughput", "request_goodput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
            "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms", "max_concurrent_requests", "server_preemptions",
            "total_kv_wait_s", "total_num_preemptions", "total_recomputed_tokens", "total_map_unmap_s")


def parse_rates(items: list[str]) -> list[float]:
    try:
        rates = [float(x) for x in items]
    except ValueError:
        raise ConfigError(f"bad --request-rates {','.join(items)}: numbers or inf, e.g. 1,2,4,inf") from None
    if any(not r > 0 for r in rates):
        raise ConfigError("every request rate must be > 0 (or inf)")
    return rates


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


def run_sweep(spec: LoadSpec, backends: list[str], rates: list[float], out_dir: str | None,
              server_args: list[str]) -> int:
    """Every backend's server in turn, every rate against it; `spec.model` is the kvlab preset served."""
    with sigterm_unwinds():
        return _sweep(spec, backends, rates, out_dir, server_args)


def _sweep(spec: LoadSpec, backends: list[str], rates: list[float], out_dir: str | None,
           server_args: list[str]) -> int:
    out = Path(out_dir or Path("results") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for backend in backends:
        with kvlab_server(backend, spec.model or "tiny", server_args) as url:
            for rate in rates:
                before = server_counter(url, "kvlab_preemptions_total")
                with StatsSampler(url) as sampler:
                    row = bench_once(spec, url, rate) | {"backend": backend}
                row["timeline"] = sampler.series
                row["timeline_poll_errors"] = sampler.errors
                row["server_preemptions"] = server_counter(url, "kvlab_preemptions_total") - before
                rows.append(row)
                print(f"{backend:8} rate {rate:>6g}: {row['completed']} done, p99 TTFT {row['p99_ttft_ms']:.1f} ms, "
                      f"p99 TPOT {row['p99_tpot_ms']:.2f} ms, {row['output_throughput']:.0f} tok/s", flush=True)
                warning = overload_line(rate, row.get("request_throughput"))
                if warning:
                    print(f"{backend:8} rate {rate:>6g}: {warning}", flush=True)
    sweep_s = time.perf_counter() - t0
    write(out, rows, sweep_s, spec, backends, sweep_record(spec, backends, rates, server_args))
    print(f"sweep: {len(backends)} backends x {len(rates)} rates in {sweep_s:.1f} s; wrote {out}")
    return 0 if all(r["completed"] for r in rows) else 1


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
    meta = {"sweep_seconds": sweep_s, "backends": backends, "num_prompts": spec.num_prompts,
            "dataset": spec.dataset, "burstiness": spec.burstiness, "seed": spec.seed,
            "goodput": list(spec.goodput) if spec.goodput is not None else None}
    (out / "serve.json").write_text(json.dumps(jsonable({"provenance": record, "meta": meta, "runs": rows}),
                                               indent=1))
    with open(out / "serve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_KEYS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    log_rows = [{"backend": r["backend"], "request_rate": r["request_rate"]} | q for r in rows
                for q in r.get("requests", [])]
    if log_rows:
        with open(out / "serve_requests.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(log_rows[0]))
            w.writeheader()
            w.writerows(log_rows)
    from kvlab.experiments.loadgen.report import write_report
    write_report(out, rows, meta, record)
