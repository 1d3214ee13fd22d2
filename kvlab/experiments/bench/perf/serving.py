"""Served against offline at saturation (tiny model): `kvlab serve` output tok/s over offline `LLM.generate` on the
same 64 requests (32 prompt + 64 output tokens, all at t = 0), the load generator on the same machine. The goal
is issue 39's: HTTP and streaming cost at most 5% (issue 13's was 15%). The engine-in-a-thread row is a
reference, held to nothing. Where there are two CPUs or more, the engine (offline, and the server's engine process)
runs on one of its own and the HTTP server and load generator on the others (bench/core_split.py); the note says so.
The measurement itself is experiments/bench/serving_overhead.py.
"""
from __future__ import annotations

from kvlab.experiments.bench.perf.harness import Goal, Result, Settings

FAMILY = "serving"
GOAL = Goal(">=", 0.95)
MAX_REPEATS = 9          # one pair is about 2 s on a 2-core CPU, plus ~5 s to start the server


def run(settings: Settings) -> list[Result]:
    from kvlab.experiments.bench import serving_overhead as overhead
    reqs = overhead.workload(4, 8, 8, settings.seed) if settings.quick else overhead.workload(seed=settings.seed)
    repeats = min(settings.repeats, MAX_REPEATS)
    backends = ("vmm",) if settings.quick else ("vmm", "paged")
    rows = []
    for backend in backends:
        d = overhead.measure(backend, reqs, repeats, threads=settings.threads)
        rows.append(Result(FAMILY, f"{backend}: served / offline output tok/s at saturation", d["served_share"], "x",
                           GOAL, note=f"{d['overhead_us_per_token']:.1f} us of wall time per streamed token; "
                                      f"{d['served_tok_s']:.0f} vs {d['offline_tok_s']:.0f} tok/s; {d['placement']}",
                           detail=d | {"per_repeat": d["served_share_per_repeat"]}))
    if settings.quick:                       # the same measurement with one flag changed: nothing new to smoke
        return rows
    d = overhead.measure("vmm", reqs, repeats, engine_thread=True, threads=settings.threads)
    rows.append(Result(FAMILY, "vmm, engine in a thread (--engine-thread): served / offline", d["served_share"], "x",
                       note=f"{d['overhead_us_per_token']:.1f} us per streamed token (one GIL for engine and HTTP)",
                       detail=d | {"per_repeat": d["served_share_per_repeat"]}))
    return rows
