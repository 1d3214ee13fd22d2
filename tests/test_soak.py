"""Soak: thousands of requests through the real Scheduler and Engine with a tiny KV budget and random aborts
(accounting mode, a runner without a model), and 500 requests through the real tiny model on each backend.
At the end nothing is held (units, tables, slots, mappings, host swap copies, background threads) and resident
memory, measured after a warm-up run, is back near where it started. The figures are printed.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from helpers.invariants import (
    SHAPE,
    CheapRunner,
    check_closed,
    check_drained,
    kvlab_threads,
    memfd_mappings,
    one_torch_thread,  # noqa: F401 - module fixture
    rss_bytes,
    settled_rss,
)

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.kv.seam import create_cache
from kvlab.common.sampling_params import SamplingParams

MiB = 1024**2
# a tiny budget: a few requests at a time, so admission waits, preemption and swap happen all the time
ACCOUNTING = {"paged": {"block_size": 4, "kv_cache_bytes": 32 * 4 * SHAPE.bytes_per_token, "preemption_mode": "swap"},
              "vmm": {"page_size": 4096, "kv_cache_bytes": 8 * 4 * 4096, "preemption_mode": "recompute"},
              "reserve": {"reserve_mode": "oracle", "kv_cache_bytes": 192 * SHAPE.bytes_per_token,
                              "preemption_mode": "swap"}}
REAL = {"paged": {"block_size": 8}, "vmm": {"page_size": 4096, "background_mapping": True, "preemption_mode": "swap"},
        "reserve": {"reserve_mode": "oracle"}}
TINY_TOKEN_BYTES = 2 * 4 * 2 * 64 * 4        # the tiny preset's K+V per token (4 layers, 2 KV heads, d=64, fp32)


@dataclass
class SoakResult:
    requests: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    steps: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    swap_preemptions: int = 0
    seconds: float = 0.0
    peak_rss: int = 0

    def line(self) -> str:
        return (f"{self.requests} requests ({self.finished} finished, {self.failed} failed alone, {self.aborted} "
                f"aborted), {self.steps} steps, {self.output_tokens} tokens, {self.preemptions} preemptions "
                f"({self.swap_preemptions} by swap) in {self.seconds:.1f} s")


def drive(engine: Engine, num_requests: int, seed: int, max_prompt: int, max_tokens: int,
          in_flight: int = 24, abort_p: float = 0.02) -> SoakResult:
    """Keep about `in_flight` requests queued; abort a random unfinished one with probability abort_p per step."""
    rng = random.Random(seed)
    sched = engine.scheduler
    r = SoakResult()
    outputs: Counter[str] = Counter()
    start = time.perf_counter()
    while r.requests < num_requests or engine.has_unfinished():
        while r.requests < num_requests and len(sched.requests) < in_flight:
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, max_prompt))]
            params = SamplingParams(n=rng.choice([1, 1, 1, 2]), max_tokens=rng.randint(1, max_tokens),
                                    temperature=rng.choice([0.0, 0.8]), ignore_eos=rng.random() < 0.5)
            engine.add_request(prompt, params, request_id=f"s{seed}-{r.requests}")
            r.requests += 1
        if sched.requests and rng.random() < abort_p:
            r.aborted += engine.abort(rng.choice(list(sched.requests)))
        for out in engine.step().finished:
            outputs[out.request_id] += 1
            r.finished += out.error is None
            r.failed += out.error is not None
            r.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        r.steps += 1
        if r.steps % 500 == 0:
            sched.check_invariants()
            engine.cache.check_invariants()
            r.peak_rss = max(r.peak_rss, rss_bytes())
    r.seconds = time.perf_counter() - start
    r.preemptions = sched.stats.preemptions
    r.swap_preemptions = sched.stats.swap_preemptions
    assert all(n == 1 for n in outputs.values()), "a request produced two outputs"
    assert r.finished + r.failed + r.aborted == r.requests, r
    return r


def accounting_engine(backend: str, seed: int) -> Engine:
    config = make_config(backend=backend, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                          watermark=0.01, **ACCOUNTING[backend])
    return Engine(config, create_cache(config, SHAPE, accounting_only=True), CheapRunner(seed), eos_token_ids=(2,),
                  timeline_every=100)


def real_engine(backend: str, seed: int) -> Engine:
    config = make_config(model="tiny", backend=backend, kv_cache_bytes=160 * TINY_TOKEN_BYTES, max_model_len=128,
                          max_num_seqs=8, max_num_batched_tokens=128, seed=seed, **REAL[backend])
    return Engine.from_config(config, timeline_every=100)


def warm_gemm_row_counts(engine: Engine) -> None:
    """oneDNN JIT-compiles and keeps a primitive for each row count a Linear layer meets (~0.65 MiB each, in caches
    of 1,024 entries: docs/performance.md, "oneDNN's memory per row count"). That is a first use, paid here for every
    row count a step can have, so that the soak measures what kvlab itself holds. No model (accounting): nothing."""
    model = getattr(engine.runner, "model", None)
    if model is None:
        return
    layers = {tuple(m.weight.shape): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    with torch.inference_mode():
        for layer in layers.values():
            for rows in range(1, engine.config.max_num_batched_tokens + 1):
                layer(torch.zeros(rows, layer.in_features))


def soak(make, backend: str, num_requests: int, warmup: int, margin: int, capsys, **limits) -> SoakResult:
    """A throw-away warm-up engine (first-use costs), then: baseline; a new engine warmed up; the soak on it;
    close. Resident memory must come back near the warmed-up engine's level during the run and near the
    baseline after close."""
    threads, memfd = kvlab_threads(), memfd_mappings()
    engine = make(backend, 1)
    drive(engine, warmup, seed=1, **limits)
    warm_gemm_row_counts(engine)
    engine.close()
    del engine
    base = settled_rss()
    engine = make(backend, 2)
    drive(engine, warmup, seed=2, **limits)
    start = settled_rss()
    result = drive(engine, num_requests, seed=3, **limits)
    end = settled_rss()      # a server keeps its engine: what it still holds after the run matters
    cache = engine.cache
    check_drained(cache)
    engine.close()
    check_closed(cache, threads, memfd)
    del engine, cache
    after = settled_rss()
    with capsys.disabled():
        print(f"\n[soak] {backend}: {result.line()}; RSS with the engine open: {start / MiB:.1f} MiB after warm-up, "
              f"peak {max(result.peak_rss, end) / MiB:.1f}, {end / MiB:.1f} at the end ({(end - start) / MiB:+.1f}); "
              f"after close {after / MiB:.1f} MiB vs {base / MiB:.1f} before it was built "
              f"({(after - base) / MiB:+.1f})")
    assert result.finished > num_requests // 2 and result.aborted > 0, result
    assert result.preemptions > 0 or backend == "reserve", result   # reserve admits fewer instead of preempting
    assert end - start < margin, f"resident memory grew by {(end - start) / MiB:.1f} MiB during the run"
    assert after - base < margin, f"resident memory is {(after - base) / MiB:.1f} MiB above its level before"
    return result


BACKENDS = ["paged", "vmm", "reserve"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_soak_1000_requests_accounting(backend, capsys):
    soak(accounting_engine, backend, 1000, warmup=300, margin=8 * MiB, capsys=capsys, max_prompt=100, max_tokens=28)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_soak_10000_requests_accounting(backend, capsys):
    soak(accounting_engine, backend, 10_000, warmup=1000, margin=16 * MiB, capsys=capsys, max_prompt=100,
         max_tokens=28)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_soak_500_requests_tiny_model(backend, capsys):
    soak(real_engine, backend, 500, warmup=60, margin=32 * MiB, capsys=capsys, max_prompt=48, max_tokens=16,
         in_flight=12)
