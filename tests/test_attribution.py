"""Per-request KV attribution on a hand-made schedule: a budget that holds one request at a time, a clock that
ticks 1.0 per step, so every wait is known exactly."""
from __future__ import annotations

import pytest
from helpers.invariants import PAGE, SHAPE

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.kv.seam import create_cache
from kvlab.common.sampling_params import SamplingParams


class TickRunner:
    """Token 7 for every item needing logits; each step takes one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def execute(self, out) -> dict[int, int]:
        self.now += 1.0
        return {it.seq.seq_id: 7 for it in out.items if it.needs_logits}


def one_at_a_time(backend: str, preemption: bool) -> dict[str, object]:
    """Two requests arriving at t=0 with 4 output tokens each, in a 32-token budget (16-token blocks and pages).
    Without `preemption`: 20-token prompts, so one request at a time fits. With it: 16-token prompts, both
    admitted, and the older one's growth preempts the newer one by recompute."""
    prompt = 16 if preemption else 20
    config = make_config(backend=backend, block_size=16, page_size=PAGE, kv_cache_bytes=32 * SHAPE.bytes_per_token,
                         max_num_seqs=2, max_model_len=24, preemption_mode="recompute", watermark=0.0)
    engine = Engine(config, create_cache(config, SHAPE, accounting_only=True), TickRunner())
    try:
        for rid in "ab":
            engine.add_request([3] * prompt, SamplingParams(max_tokens=4, ignore_eos=True), request_id=rid,
                               arrival_time=0.0)
        outputs = {}
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step().finished})
        return outputs
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["paged", "vmm", "reserve"])
def test_a_request_queued_behind_another_waits_exactly_its_run(backend):
    out = one_at_a_time(backend, preemption=False)
    a, b = out["a"].metrics, out["b"].metrics
    assert a.kv_wait_s == 0.0 and a.num_preemptions == 0
    assert b.kv_wait_s == pytest.approx(4.0)          # a's four steps (prefill + 3 decodes), then b is admitted
    assert b.first_token_time == pytest.approx(5.0)


@pytest.mark.parametrize("backend", ["paged", "vmm"])
def test_a_preempted_request_waits_from_preemption_to_readmission(backend):
    out = one_at_a_time(backend, preemption=True)
    b = out["b"].metrics
    assert b.num_preemptions >= 1 and b.recomputed_tokens > 0
    assert b.kv_wait_s > 0
    assert out["a"].metrics.kv_wait_s == 0.0
