"""The paired load measurement of docs/disaggregation.md: disaggregated serving (one prefill and one decode engine
behind the router) against colocated serving (two colocated engines behind the same router, round-robin): the
same engines, processes and router hop on each side, the same `kvlab bench serve` load (identical seeded
arrivals and prompts), the order alternating between repeats. One JSON result per run, then the table.

    python -m kvlab.experiments.serve.pd_load --backend vmm --repeats 3 --out results/pd -- \\
        --num-prompts 60 --request-rate 4 --random-input-len 512 --random-output-len 64 --goodput ttft:500 tpot:50
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shlex
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from kvlab.experiments.serve.health import ServerNotReady, wait_healthy

SETUPS = {"disaggregated": ("prefill", "decode"), "colocated": ("colocated", "colocated")}
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "request_goodput")
START_S, STOP_S = 180, 30
CLI = [sys.executable, "-m", "kvlab.experiments.cli.main"]


def start(*args: str) -> tuple[subprocess.Popen, str]:
    """A `kvlab serve` in a session of its own, and its URL from its start line."""
    proc = subprocess.Popen([*CLI, "serve", "--port", "0", *args], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], START_S)
    found = re.search(r"http://\S+", proc.stdout.readline() if ready else "")
    if found is None:
        stop(proc)
        raise SystemExit(f"kvlab serve {' '.join(args)} gave no start line within {START_S} s")
    return proc, found.group(0)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_router(router: subprocess.Popen, url: str) -> None:
    try:
        wait_healthy(url, START_S, router)
    except ServerNotReady as e:
        raise SystemExit(str(e)) from None


def run_setup(name: str, engine_flags: list[str], bench_flags: list[str], out: Path, repeat: int) -> dict:
    """Start the setup's two engines and the router, run the load once, stop everything; the bench's result."""
    procs: list[subprocess.Popen] = []
    try:
        urls: dict[str, list[str]] = {}
        for role in SETUPS[name]:
            proc, url = start("--role", role, *engine_flags)
            procs.append(proc)
            urls.setdefault(role, []).append(url)
        router, url = start("--role", "router", *[a for role, found in urls.items() for a in (f"--{role}", *found)])
        procs.append(router)
        wait_router(router, url)
        filename = f"{name}-{repeat}.json"
        subprocess.run([*CLI, "bench", "serve", "--base-url", url, *bench_flags, "--metric-percentiles", "50,99",
                        "--save-result", "--result-dir", str(out), "--result-filename", filename, "--disable-tqdm"],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads((out / filename).read_text())
    finally:
        for proc in reversed(procs):
            stop(proc)


def table(runs: dict[str, list[dict]]) -> str:
    """Per setup and metric: the median over repeats [min, max]; then the paired difference (disaggregated minus
    colocated, repeat by repeat): its median [min, max]."""
    lines = ["| setup | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
    for name, results in runs.items():
        lines.append(f"| {name} | " + " | ".join(spread([r[m] for r in results]) for m in METRICS) + " |")
    paired = list(zip(runs["disaggregated"], runs["colocated"]))
    diffs = {m: [d[m] - c[m] for d, c in paired] for m in METRICS}
    lines.append("| paired difference | " + " | ".join(spread(diffs[m]) for m in METRICS) + " |")
    return "\n".join(lines)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlab.experiments.serve.pd_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="vmm")
    p.add_argument("--model", default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pool-bytes", default="1GiB", help="vmm: the shared page pool's budget")
    p.add_argument("--engine-flags", type=shlex.split, default=[],
                   help='more `kvlab serve` flags for every engine, one string: --engine-flags="--max-num-seqs 8"')
    p.add_argument("--out", type=Path, default=Path("results/pd"))
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the `kvlab bench serve` flags of the load")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    engine_flags = ["--model", args.model, "--backend", args.backend, *args.engine_flags]
    if args.backend == "vmm":           # the handoff moves pool pages; the colocated engines draw from a pool too
        engine_flags += ["--kv-pool", f"pd-load-{os.getpid()}", "--kv-pool-bytes", args.pool_bytes]
    bench = [a for a in args.bench if a != "--"]
    runs: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for repeat in range(args.repeats):
        order = list(SETUPS) if repeat % 2 == 0 else list(reversed(SETUPS))
        for name in order:
            runs[name].append(run_setup(name, engine_flags, bench, args.out, repeat))
            print(f"repeat {repeat}: {name} done", flush=True)
    text = table(runs)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
