"""What fp8 KV costs on the CPU engine: time spent quantising (on write) and dequantising (in the kernels) per
decode step, as a share of the step. `python -m kvlab.experiments.bench.fp8_cost [--model tiny] [--backends paged,vmm]`

Decode-only numbers: a run with `max_tokens = 1 + N` minus a prefill-only run (`max_tokens = 1`) of the same
prompts, so prefill's quantisation and attention drop out. Quantise/dequantise time is measured by wrapping
common/attention/kv_quant.py's `encode` and `decode` (every kernel goes through them).
"""
from __future__ import annotations

import argparse
import time

import torch

from kvlab.common.attention import kv_quant
from kvlab.common.llm import LLM
from kvlab.common.sampling_params import SamplingParams


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def measure(model: str, backend: str, kv: str, batch: int, prompt: int, new: int) -> dict[str, float]:
    timer = Timer()
    originals = kv_quant.encode, kv_quant.decode
    kv_quant.encode, kv_quant.decode = timer.wrap(originals[0]), timer.wrap(originals[1])
    try:
        llm = LLM(model=model, backend=backend, kv_cache_dtype=kv, kv_cache_bytes=256 * 2**20,
                  max_model_len=prompt + new + 16, max_num_seqs=batch)
        prompts = [[3 + (7 * i + j) % 500 for j in range(prompt)] for i in range(batch)]
        runs = {}
        for tokens in (1, 1 + new, 1, 1 + new):      # warm-up pair, then the measured pair
            timer.seconds = 0.0
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            runs[tokens] = (time.perf_counter() - start, timer.seconds)
        llm.engine.close()
    finally:
        kv_quant.encode, kv_quant.decode = originals
    step = (runs[1 + new][0] - runs[1][0]) / new
    quant = (runs[1 + new][1] - runs[1][1]) / new
    return {"step_ms": step * 1e3, "quant_ms": quant * 1e3, "share": quant / step if step > 0 else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--backends", default="paged,vmm,reserve")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{args.model}, batch {args.batch}, prompt {args.prompt}, {args.new} decode steps, 1 thread")
    for backend in args.backends.split(","):
        base = measure(args.model, backend, "auto", args.batch, args.prompt, args.new)
        fp8 = measure(args.model, backend, "fp8_e4m3", args.batch, args.prompt, args.new)
        print(f"{backend:8s} decode step: auto {base['step_ms']:.2f} ms, fp8_e4m3 {fp8['step_ms']:.2f} ms "
              f"({fp8['step_ms'] / base['step_ms']:.2f}x); quantise+dequantise {fp8['quant_ms']:.2f} ms "
              f"= {100 * fp8['share']:.0f}% of the fp8 step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
