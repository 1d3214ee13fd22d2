"""Benchmark (not a test): served output tok/s at saturation against offline LLM.generate on the same workload,
and the HTTP + streaming overhead per output token. One LLM and one `kvlab serve` stay up; offline and served
runs alternate `--repeats` times (perf/harness.py's `interleaved`), and medians are reported (timing here is
noisy). The perf suite's `serving` family runs the same measurement.

    python -m kvlab.experiments.bench.serving_overhead [--backend vmm] [--num-prompts 64] [--input-len 32]
        [--output-len 64] [--repeats 5] [--engine-thread] [--threads 1] [--no-pin]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from kvlab.common.llm import LLM
from kvlab.common.sampling_params import SamplingParams
from kvlab.experiments.bench.core_split import placed
from kvlab.experiments.bench.perf.harness import interleaved, paired_ratios
from kvlab.experiments.loadgen.client import Target, run_load
from kvlab.experiments.loadgen.datasets import LoadRequest, build
from kvlab.experiments.loadgen.sweep import kvlab_server


def workload(num_prompts: int = 64, input_len: int = 32, output_len: int = 64, seed: int = 0) -> list[LoadRequest]:
    return build("random", num_prompts, seed, 259, input_len=input_len, output_len=output_len)


def offline_run(llm: LLM, reqs: list[LoadRequest], tokens: list[int]):
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]

    def run() -> float:
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params)
        seconds = time.perf_counter() - t0
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outs))
        return seconds
    return run


def served_run(url: str, reqs: list[LoadRequest], tokens: list[int]):
    target = Target(url, ignore_eos=True)           # as offline: every request makes all its tokens

    def run() -> float:
        records, duration, _ = asyncio.run(run_load(target, reqs, [0.0] * len(reqs)))
        failed = [r.error for r in records if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} served requests failed, e.g. {failed[0]}")
        tokens.append(sum(r.output_tokens for r in records))
        return duration
    return run


def measure(backend: str, reqs: list[LoadRequest], repeats: int, engine_thread: bool = False,
            threads: int = 1, pin: bool = True) -> dict[str, Any]:
    """`pin`: the engine on a CPU of its own, offline and served alike (bench/core_split.py)."""
    flags = ["--threads", str(threads)] + (["--engine-thread"] if engine_thread else [])
    tokens: dict[str, list[int]] = {"offline": [], "served": []}
    with LLM(model="tiny", backend=backend, threads=threads) as llm, kvlab_server(backend, "tiny", flags) as url:
        offline_run(llm, reqs[:4], [])()                                 # warm-up, both sides
        served_run(url, reqs[:4], [])()
        offline, served = offline_run(llm, reqs, tokens["offline"]), served_run(url, reqs, tokens["served"])
        placement = "not pinned: --no-pin"
        if pin:
            offline, served, placement = placed(offline, served, threads, engine_thread)
        timings = interleaved({"offline": offline, "served": served}, repeats)
    counts = set(tokens["offline"]) | set(tokens["served"])
    if len(counts) != 1:
        raise RuntimeError(f"offline and served runs made different token counts: {tokens}")
    n = counts.pop()
    t_off, t_srv = timings["offline"].median, timings["served"].median
    shares = paired_ratios(timings["offline"], timings["served"])["per_repeat"]     # offline s / served s
    return {"backend": backend, "engine": "thread" if engine_thread else "process", "placement": placement,
            "output_tokens": n, "repeats": repeats, "offline_s": t_off, "served_s": t_srv, "offline_tok_s": n / t_off,
            "served_tok_s": n / t_srv, "served_share": t_off / t_srv,
            "served_share_per_repeat": shares, "served_share_median_of_pairs": statistics.median(shares),
            "overhead_us_per_token": (t_srv - t_off) / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="vmm")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads, offline and in the server")
    p.add_argument("--engine-thread", action="store_true", help="serve with the engine in a thread")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave every process on every CPU (default: the engine on a CPU of its own)")
    a = p.parse_args()
    reqs = workload(a.num_prompts, a.input_len, a.output_len)
    print(json.dumps(measure(a.backend, reqs, a.repeats, a.engine_thread, a.threads, a.pin), indent=1))


if __name__ == "__main__":
    main()
