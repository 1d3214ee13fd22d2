"""Benchmark (not a test): served output tok/s at saturation against offline LLM.generate on the same workload,
and the HTTP + streaming overhead per output token.

    python -m kvlab.experiments.serve.overhead [--backend vmm] [--num-prompts 64] [--input-len 32] [--output-len 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from kvlab.common.llm import LLM
from kvlab.common.sampling_params import SamplingParams
from kvlab.experiments.serve.client import run_load
from kvlab.experiments.serve.datasets import build
from kvlab.experiments.serve.sweep import kvlab_server


def offline(backend: str, reqs) -> tuple[float, int]:
    with LLM(model="tiny", backend=backend) as llm:
        params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
        llm.generate([r.prompt for r in reqs[:4]], params[:4])            # warm-up
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def served(backend: str, reqs) -> tuple[float, int]:
    with kvlab_server(backend, "tiny", []) as url:
        asyncio.run(run_load(url, reqs[:4], [0.0] * 4))                    # warm-up
        records, duration, _ = asyncio.run(run_load(url, reqs, [0.0] * len(reqs)))
    assert all(r.success for r in records), [r.error for r in records if not r.success][:3]
    return duration, sum(r.output_tokens for r in records)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="vmm")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    a = p.parse_args()
    reqs = build("random", a.num_prompts, 0, 259, input_len=a.input_len, output_len=a.output_len)
    t_off, n_off = offline(a.backend, reqs)
    t_srv, n_srv = served(a.backend, reqs)
    print(json.dumps({"backend": a.backend, "output_tokens": n_srv, "offline_s": t_off, "served_s": t_srv,
                      "offline_tok_s": n_off / t_off, "served_tok_s": n_srv / t_srv,
                      "served_share": (n_srv / t_srv) / (n_off / t_off),
                      "overhead_us_per_token": (t_srv - t_off) / n_srv * 1e6}, indent=1))


if __name__ == "__main__":
    main()
