"""Benchmark (not a test): served output tok/s at saturation against offline LLM.generate on the same workload,
and the HTTP + streaming overhead per output token. One LLM and one server stay up; offline and served runs
alternate `--repeats` times and the medians are reported (timing here is noisy).

    python -m kvlab.experiments.serve.overhead [--backend vmm] [--num-prompts 64] [--input-len 32]
        [--output-len 64] [--repeats 5] [--engine-thread]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from kvlab.common.llm import LLM
from kvlab.common.sampling_params import SamplingParams
from kvlab.experiments.serve.client import run_load
from kvlab.experiments.serve.datasets import build
from kvlab.experiments.serve.sweep import kvlab_server


def offline(llm: LLM, reqs) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def served(url: str, reqs) -> tuple[float, int]:
    records, duration, _ = asyncio.run(run_load(url, reqs, [0.0] * len(reqs)))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} served requests failed, e.g. {failed[0]}")
    return duration, sum(r.output_tokens for r in records)


def measure(backend: str, reqs, repeats: int, engine_thread: bool) -> dict:
    flags = ["--engine-thread"] if engine_thread else []
    with LLM(model="tiny", backend=backend) as llm, kvlab_server(backend, "tiny", flags) as url:
        offline(llm, reqs[:4])                                              # warm-up, both sides
        served(url, reqs[:4])
        runs = [(offline(llm, reqs), served(url, reqs)) for _ in range(repeats)]
    t_off = statistics.median(o[0] for o, _ in runs)
    t_srv = statistics.median(s[0] for _, s in runs)
    n = runs[0][1][1]
    shares = [(s[1] / s[0]) / (o[1] / o[0]) for o, s in runs]
    return {"backend": backend, "engine": "thread" if engine_thread else "process", "output_tokens": n,
            "repeats": repeats, "offline_s": t_off, "served_s": t_srv, "offline_tok_s": n / t_off,
            "served_tok_s": n / t_srv, "served_share": statistics.median(shares),
            "served_share_min_max": [min(shares), max(shares)],
            "overhead_us_per_token": (t_srv - t_off) / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="vmm")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engine-thread", action="store_true", help="serve with the engine in a thread")
    a = p.parse_args()
    reqs = build("random", a.num_prompts, 0, 259, input_len=a.input_len, output_len=a.output_len)
    print(json.dumps(measure(a.backend, reqs, a.repeats, a.engine_thread), indent=1))


if __name__ == "__main__":
    main()
