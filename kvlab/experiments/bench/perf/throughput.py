"""Engine vs HF transformers: useful output tokens per second on the same tiny model, same requests.

Requests follow the seed article's log-normal lengths (scaled for CPU). kvlab serves them with continuous
batching at most `batch_size` at a time; HF `generate` serves them in static batches of the same size, padded,
each batch decoding until its longest request is done. Only each request's own output tokens count as
useful, so HF's over-generation is waste. Rounds alternate engine and HF runs; each reports its median.
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

FAMILY = "throughput"
GOAL = Goal(">=", 3.0)
BACKENDS = ("paged", "vmm")


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int
    batch_size: int
    scale: float           # seed lengths x scale (1/8: prompts median 73, outputs mean 47, max length 512)

    @property
    def max_len(self) -> int:
        return int(4096 * self.scale)


def workload_for(settings: Settings) -> Workload:
    return Workload(8, 4, 1 / 32) if settings.quick else Workload(64, 16, 1 / 8)


def make_requests(w: Workload, vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    from kvlab.experiments.workloads.requests import WorkloadSpec, build_workload, prompt_token_ids
    spec = WorkloadSpec(kind="seed", num_requests=w.num_requests, seed=seed, scale=w.scale)
    requests = build_workload(spec)
    return prompt_token_ids(requests, vocab_size, seed), [r.output_len for r in requests]


def engine_runner(backend: str, w: Workload, settings: Settings, prompts: list[list[int]], lens: list[int]):
    """An LLM with room for the whole batch (no preemption) and a function timing one full generate()."""
    from kvlab import LLM, SamplingParams
    per_token = tiny_kv_bytes_per_token()
    kv_bytes = max(16 * 2**20, 4 * w.batch_size * w.max_len * per_token)
    llm = LLM("tiny", backend=backend, max_num_seqs=w.batch_size, max_model_len=w.max_len,
              max_num_batched_tokens=max(2048, w.batch_size), kv_cache_bytes=kv_bytes, threads=settings.threads,
              seed=settings.seed)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in lens]
    llm.generate(prompts[:2], params[:2])     # warm-up: kernels, allocator pools, RoPE tables
    useful = sum(lens)

    def run() -> float:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != useful:
            raise AssertionError(f"{backend}: produced {produced} tokens, the requests ask for {useful}")
        return seconds
    return llm, run


def hf_runner(model, w: Workload, prompts: list[list[int]], lens: list[int]):
    from kvlab.experiments.bench.perf.hf_baseline import static_batches, to_hf
    hf = to_hf(model)
    static_batches(hf, prompts[:2], [2, 2], 2)    # warm-up
    info: dict[str, int] = {}

    def run() -> float:
        result = static_batches(hf, prompts, lens, w.batch_size)
        info.update(useful=result.useful_tokens, generated=result.generated_tokens, batches=result.batches)
        return result.seconds
    return run, info


def run(settings: Settings) -> list[Result]:
    from kvlab.common.presets import load_tiny
    w = workload_for(settings)
    model, _ = load_tiny("float32", "cpu", settings.seed)
    prompts, lens = make_requests(w, model.config.vocab_size, settings.seed)
    useful = sum(lens)
    hf_run, hf_info = hf_runner(model, w, prompts, lens)
    timings = interleaved_llms(lambda backend: engine_runner(backend, w, settings, prompts, lens), BACKENDS,
                               settings.repeats, others={"hf": hf_run})
    hf_tps = useful / timings["hf"].median
    shape = {"requests": w.num_requests, "batch_size": w.batch_size, "max_len": w.max_len,
             "useful_tokens": useful, "prompt_tokens": sum(len(p) for p in prompts)}
    rows = [Result(FAMILY, "hf generate: useful tokens/s", hf_tps, "tok/s",
                   note=f"static batches of {w.batch_size}, {hf_info['generated'] - useful} tokens over-generated",
                   detail={**shape, **hf_info, **timing_detail(timings["hf"])})]
    for backend in BACKENDS:
        tps = useful / timings[backend].median
        rows.append(Result(FAMILY, f"engine ({backend}): useful tokens/s", tps, "tok/s",
                           detail={**shape, **timing_detail(timings[backend])}))
        rows.append(Result(FAMILY, f"engine ({backend}) / hf generate", ratio(tps, hf_tps), "x", GOAL,
                           note="useful output tokens/s, same weights and requests",
                           detail=paired_ratios(timings["hf"], timings[backend])))
    return rows
