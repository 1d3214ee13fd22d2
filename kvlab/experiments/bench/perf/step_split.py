"""Where a decode step's time goes, beside the roofline's share: the model's matmuls (every Linear, the LM head
included), its attention (the KV cache's write and kernel, per layer), the rest of the forward (embedding, norms,
RoPE, activations, residuals) and the engine around the forward (scheduling, the step's metadata, sampling).

The three calls are wrapped on one LLM for one pair of generate() lengths, so prefill and the fixed cost of a
generate() cancel as in the share, and apart from the share's own rounds: each wrapped call reads the clock twice
(22 calls a step on a 4-layer model), which is small but not nothing. The matmuls timed inside the engine can
take longer than the limit's, timed alone: there the next weight is still in cache.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvlab.common.model import Linear

PARTS = ("matmul", "attention", "forward")


@dataclass(frozen=True, slots=True)
class StepSplit:
    """Milliseconds of one decode step, by part (they sum to `step`)."""
    step: float
    matmul: float
    attention: float
    other_forward: float
    engine: float

    def describe(self, matmul_alone_ms: float) -> str:
        return (f"a decode step {self.step:.2f} ms: matmuls {self.matmul:.2f} (alone {matmul_alone_ms:.2f}), "
                f"attention {self.attention:.2f}, rest of the forward {self.other_forward:.2f}, "
                f"engine outside the forward {self.engine:.2f}")


def _timing(fn: Callable, seconds: dict[str, float], part: str) -> Callable:
    clock = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[part] += clock() - start
    return timed


@contextmanager
def timed_parts(llm: Any) -> Iterator[dict[str, float]]:
    """Seconds in the model's matmuls, the cache's attention and the whole forward while inside; every wrapper is
    removed on the way out."""
    runner = llm.engine.runner
    model, storage = runner.model, runner.cache          # the runner holds the storage
    seconds = dict.fromkeys(PARTS, 0.0)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    gemms = [m.gemm for m in linears]
    for m, gemm in zip(linears, gemms):
        m.gemm = _timing(gemm, seconds, "matmul")
    storage.attention = _timing(storage.attention, seconds, "attention")   # instance attributes shadow the methods
    model.forward = _timing(model.forward, seconds, "forward")
    try:
        yield seconds
    finally:
        for m, gemm in zip(linears, gemms):
            m.gemm = gemm
        del storage.attention
        del model.forward


def decode_split(llm: Any, generate: Callable[[int], float], short: int, long: int) -> StepSplit:
    """The split of one decode step: the parts' seconds over a long generate() less a short one, per extra step."""
    with timed_parts(llm) as seconds:
        wall_short = generate(short)
        parts_short = dict(seconds)
        wall_long = generate(long)
    per_step = 1e3 / (long - short)
    ms = {part: (seconds[part] - 2 * parts_short[part]) * per_step for part in PARTS}
    step = (wall_long - wall_short) * per_step
    return StepSplit(step, ms["matmul"], ms["attention"], ms["forward"] - ms["matmul"] - ms["attention"],
                     step - ms["forward"])
