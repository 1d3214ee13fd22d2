"""End to end on the real tiny model: every backend and preemption mode against the cache-free reference."""
from __future__ import annotations

import random

import pytest
import torch

from kvlab import LLM, SamplingParams

TOKEN_BYTES = 4096              # tiny model, fp32: 2 (K, V) x 4 layers x 2 KV heads x 64 x 4 bytes
MAX_LEN = 96


def workload(seed: int = 0, count: int = 14) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(count):
        prompts.append([1] + [rng.randrange(3, 1024) for _ in range(rng.randrange(2, 24))])
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(8, 50),
                                     ignore_eos=rng.random() < 0.5))
    return prompts, params


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    ids = list(prompt)
    eos = set(model.config.eos_token_ids)
    for _ in range(p.max_tokens):
        tok = int(model.reference_forward(torch.tensor([ids]))[0, -1].argmax())
        ids.append(tok)
        if tok in eos and not p.ignore_eos:
            break
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def expected():
    from kvlab.common.loader import load_model
    torch.set_num_threads(1)
    model, _ = load_model("tiny", "float32", "cpu", 0)
    prompts, params = workload()
    return [reference_greedy(model, pr, p) for pr, p in zip(prompts, params)]


def llm(backend: str, tokens: int, **overrides) -> LLM:
    values = dict(kv_cache_bytes=tokens * TOKEN_BYTES, max_model_len=MAX_LEN, block_size=8, page_size=4096,
                  max_num_batched_tokens=64, max_num_seqs=8, check_invariants=True, threads=1)
    values.update(overrides)
    return LLM("tiny", backend=backend, **values)


CASES = [
    ("paged", 96, dict(preemption_mode="recompute")),
    ("paged", 96, dict(preemption_mode="swap")),
    ("vmm", 96, dict(preemption_mode="recompute")),
    ("vmm", 96, dict(preemption_mode="swap")),
    ("paged", 2048, dict()),
    ("vmm", 2048, dict(background_mapping=True)),
    ("reserve", 200, dict(reserve_mode="max")),
    ("reserve", 160, dict(reserve_mode="oracle")),
]


@pytest.mark.parametrize("backend, tokens, overrides", CASES,
                         ids=[f"{b}-{t}-{'-'.join(map(str, o.values())) or 'roomy'}" for b, t, o in CASES])
def test_greedy_equals_the_cache_free_reference(expected, backend, tokens, overrides):
    """Covers float32 only (the default dtype here): in bfloat16/float16 the backends' kernels reduce in
    different orders and greedy tokens may differ (docs/reliability.md, "Mixed precision")."""
    prompts, params = workload()
    with llm(backend, tokens, **overrides) as engine:
        outputs = engine.generate(prompts, params)
        got = [o.outputs[0].token_ids for o in outputs]
        assert got == expected
        m = engine.metrics()
        if tokens == 96:     # a budget that forces preemption
            assert m.preemptions >= 10, m.preemptions
            if overrides["preemption_mode"] == "swap":
                assert m.swap_preemptions == m.preemptions and m.swapped_out_bytes > 0
            else:
                assert m.recompute_preemptions == m.preemptions and m.recomputed_tokens > 0
        assert engine.cache_stats().used_units == 0
        assert engine.cache_stats().live_tokens == 0


@pytest.mark.parametrize("backend", ["paged", "vmm", "reserve"])
def test_seeded_sampling_is_identical_across_backends_and_preemption(backend):
    """Covers float32 only (the default dtype here): in bfloat16/float16 the backends' kernels reduce in
    different orders and greedy tokens may differ (docs/reliability.md, "Mixed precision")."""
    prompts, _ = workload(seed=1, count=6)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=20,
                             ignore_eos=True)
              for i in range(len(prompts))]
    with llm("paged", 2048) as roomy:
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    with llm(backend, 120, preemption_mode="recompute", reserve_mode="oracle") as tight:
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
        assert tight.cache_stats().used_units == 0
    assert got == want


@pytest.mark.parametrize("backend", ["paged", "vmm"])
def test_parallel_sampling_holds_less_kv_than_separate_requests(backend):
    prompt = [1] + list(range(10, 70))                  # 61 tokens: most of the KV is the shared prompt
    sample = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    with llm(backend, 2048) as shared:
        out = shared.generate([prompt], sample)[0]
        m_shared = shared.metrics()
        assert shared.cache_stats().used_units == 0
    alone = SamplingParams(n=1, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    with llm(backend, 2048) as separate:
        outs = separate.generate([prompt] * 4, alone)
        m_separate = separate.metrics()
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 12 for c in out.outputs)
    assert out.outputs[0].token_ids == outs[0].outputs[0].token_ids    # sample 0 uses the same generator
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    used = m_shared.peak_used_units / m_separate.peak_used_units
    mapped = m_shared.peak_mapped_bytes / max(m_separate.peak_mapped_bytes, 1)
    assert used < 0.6, (m_shared.peak_used_units, m_separate.peak_used_units)
    if backend == "vmm":
        assert mapped < 0.6, (m_shared.peak_mapped_bytes, m_separate.peak_mapped_bytes)


@pytest.mark.parametrize("backend", ["paged", "vmm", "reserve"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_mid_run_frees_everything(backend, mode):
    prompts, params = workload(seed=2, count=6)
    with llm(backend, 160, preemption_mode=mode, reserve_mode="oracle") as engine:
        e = engine.engine
        ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
        for _ in range(8):
            e.step()
        assert e.running_sequences()
        for request_id in ids:
            e.abort(request_id)
        e.step()
        assert not e.has_unfinished()
        stats = engine.cache_stats()
        assert stats.used_units == 0 and stats.live_tokens == 0
        e.cache.check_invariants()
        again = engine.generate(prompts[:2], params[:2])    # the engine is still usable
        assert all(o.error is None for o in again)


@pytest.mark.parametrize("backend", ["paged", "vmm", "reserve"])
def test_a_request_too_big_for_the_cache_fails_alone(backend):
    prompts, params = workload(seed=3, count=4)
    big = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with llm(backend, 80, reserve_mode="oracle") as engine:     # 80 tokens of KV in all; others need <= 74
        outputs = engine.generate(prompts[:2] + [[1] * 30] + prompts[2:], params[:2] + [big] + params[2:])
        assert outputs[2].error and outputs[2].outputs[0].finish_reason == "error"
        assert [o.error for i, o in enumerate(outputs) if i != 2] == [None] * 4
        assert engine.metrics().num_failed == 1
        assert engine.cache_stats().used_units == 0


def test_prefix_caching_skips_shared_prompt_blocks(expected):
    """Requests sharing a 40-token system prompt: later ones start from cached blocks, outputs unchanged."""
    from kvlab.common.loader import load_model
    model, _ = load_model("tiny", "float32", "cpu", 0)
    system = [1] + list(range(100, 139))
    prompts = [system + [500 + i, 600 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [reference_greedy(model, p, params) for p in prompts]
    with llm("paged", 2048, enable_prefix_caching=True, max_num_seqs=1) as engine:   # one at a time
        out = engine.generate(prompts, params)
        m = engine.metrics()
        assert [o.outputs[0].token_ids for o in out] == want
        assert engine.cache_stats().prefix_hit_tokens >= 3 * 40
        assert m.computed_tokens <= sum(len(p) for p in prompts) + 4 * 6 - 3 * 40


@pytest.mark.parametrize("backend, mode", [("paged", "recompute"), ("vmm", "swap"), ("vmm", "recompute")])
def test_step_results_stream_exactly_the_final_outputs(backend, mode):
    """Each step's new tokens, joined per sample, are the final outputs (n = 1, n = 3, beam search), under a
    budget that preempts; a sample gains at most one token a step, and a beam search reports once, whole."""
    prompts, _ = workload(seed=4, count=6)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(beam_width=2, n=2, max_tokens=8, ignore_eos=True)] * 2
    with llm(backend, 120, preemption_mode=mode) as engine:
        e = engine.engine
        ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
        streamed, reports, finished = {i: [] for i in ids}, {i: 0 for i in ids}, {}
        while e.has_unfinished():
            result = e.step()
            for rid, new in result.new_tokens.items():
                reports[rid] += 1
                got = streamed[rid]
                got += [[] for _ in range(len(new) - len(got))]
                for sample, ids_ in zip(got, new):
                    sample += ids_
                is_beam = params[ids.index(rid)].use_beam_search
                assert is_beam or all(len(t) <= 1 for t in new), new
            finished.update({o.request_id: o for o in result.finished})
        assert e.scheduler_stats().preemptions > 0
    for rid, sp in zip(ids, params):
        assert streamed[rid] == [c.token_ids for c in finished[rid].outputs]
        assert reports[rid] == 1 if sp.use_beam_search else reports[rid] >= sp.max_tokens
