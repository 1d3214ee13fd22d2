"""vmm vs paged end to end through the LLM API, on a decode-heavy long-context workload (tiny model).

Sixteen requests with long prompts of different lengths and long outputs run together (max_num_seqs 16), so
most of the time goes to decode steps over contexts of 0.8-1.5k tokens, where the attention layout matters most.
Same model weights, requests and thread count for both; rounds alternate the backends; medians of up to
MAX_REPEATS runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvlab.experiments.bench.perf.harness import (
    Goal,
    Result,
    Settings,
    interleaved_llms,
    paired_ratios,
    ratio,
    timing_detail,
    tiny_kv_bytes_per_token,
)

FAMILY = "end_to_end"
GOAL = Goal(">=", 1.1)
BACKENDS = ("vmm", "paged")
MAX_REPEATS = 3          # one round is about 25 s on a 2-core CPU


@dataclass(frozen=True, slots=True)
class LongContext:
    num_requests: int
    prompt_low: int
    prompt_high: int
    output_len: int

    @property
    def max_len(self) -> int:
        return self.prompt_high + self.output_len

    def prompts(self, seed: int) -> list[list[int]]:
        import numpy as np
        rng = np.random.default_rng(seed)
        lengths = rng.integers(self.prompt_low, self.prompt_high + 1, self.num_requests)
        return [rng.integers(3, 1024, int(n)).tolist() for n in lengths]


def workload_for(settings: Settings) -> LongContext:
    return LongContext(4, 48, 64, 16) if settings.quick else LongContext(16, 768, 1280, 256)


def make_llm(backend: str, w: LongContext, settings: Settings):
    from kvlab import LLM
    per_token = tiny_kv_bytes_per_token()
    return LLM("tiny", backend=backend, max_num_seqs=w.num_requests, max_model_len=w.max_len,
               max_num_batched_tokens=max(2048, w.prompt_high), threads=settings.threads, seed=settings.seed,
               kv_cache_bytes=2 * w.num_requests * w.max_len * per_token + 2**24)


def runner(backend: str, w: LongContext, settings: Settings, prompts: list[list[int]], runs: list):
    """The backend's LLM and a function timing one generate() of every prompt (its metrics kept in `runs`)."""
    from kvlab import SamplingParams
    llm = make_llm(backend, w, settings)
    params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))   # warm-up

    def run() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        runs.append(llm.metrics())
        return seconds
    return llm, run


def run(settings: Settings) -> list[Result]:
    w = workload_for(settings)
    prompts = w.prompts(settings.seed)
    metrics: dict[str, list] = {b: [] for b in BACKENDS}
    timings = interleaved_llms(lambda backend: runner(backend, w, settings, prompts, metrics[backend]), BACKENDS,
                               min(settings.repeats, MAX_REPEATS))
    tokens = w.num_requests * w.output_len
    shape = {"requests": w.num_requests, "prompt_len": [w.prompt_low, w.prompt_high], "output_len": w.output_len}
    rows = []
    for backend in BACKENDS:
        m = metrics[backend][-1]
        rows.append(Result(FAMILY, f"{backend}: output tokens/s", tokens / timings[backend].median, "tok/s",
                           note=f"decode kernel {m.kernels.get('decode')}, mean batch {m.mean_batch:.1f}",
                           detail={**shape, **timing_detail(timings[backend]), "kernels": m.kernels,
                                   "preemptions": m.preemptions, "allocator_share": m.allocator_share}))
    rows.append(Result(FAMILY, "vmm / paged, decode-heavy long context", ratio(timings["paged"].median,
                       timings["vmm"].median), "x", GOAL,
                       note=f"{w.num_requests} requests, prompts {w.prompt_low}-{w.prompt_high}, "
                            f"{w.output_len} output tokens each",
                       detail=paired_ratios(timings["paged"], timings["vmm"])))
    return rows
