"""The LLM API, stop conditions and beam search (against an independent brute-force search)."""
from __future__ import annotations

import itertools
import json
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import LLM, SamplingParams
from kvlab.common import engine as engine_module
from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.errors import ConfigError, KvlabError, RequestError
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import ModelConfig

BACKENDS = ["paged", "vmm", "reserve"]
SMALL = dict(kv_cache_bytes=512 * 4096, max_model_len=128, page_size=4096, block_size=8, threads=1)
VOCAB = 8
EOS = 2


@pytest.fixture(scope="module")
def tiny_llm():
    with LLM("tiny", backend="paged", check_invariants=True, **SMALL) as llm:
        yield llm


@pytest.fixture(scope="module")
def small_vocab_model():
    """Vocabulary of 8 (EOS = 2) with peaked distributions, so beam search has real choices to make."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, eos_token_id=EOS, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.init_random_weights(3, std=0.3)
    return model.eval()


def small_engine(model, backend: str, **overrides) -> Engine:
    values = dict(backend=backend, kv_cache_bytes=1 << 20, max_model_len=32, page_size=4096, block_size=4,
                  max_num_seqs=64, max_num_batched_tokens=256, check_invariants=True, reserve_mode="oracle")
    values.update(overrides)
    return Engine.from_model(make_config(**values), model)


def run(engine: Engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        for o in engine.step().finished:
            outputs[o.request_id] = o
    return outputs


# -- API ---------------------------------------------------------------------------------------------------

def test_strings_in_text_out(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = tiny_llm.generate(["Hello", "kv caches"], greedy)
    assert [o.prompt for o in out] == ["Hello", "kv caches"]
    assert out[0].prompt_token_ids == tiny_llm.tokenizer.encode("Hello")
    assert isinstance(out[0].outputs[0].text, str) and len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].text == tiny_llm.tokenizer.decode(out[0].outputs[0].token_ids)
    assert out[0].outputs[0].finish_reason == "length" and out[0].metrics.ttft >= 0


def test_prompt_forms_and_per_prompt_params(tiny_llm):
    single = tiny_llm.generate("abc", SamplingParams(temperature=0, max_tokens=3))
    ids = tiny_llm.generate(tiny_llm.tokenizer.encode("abc"), SamplingParams(temperature=0, max_tokens=3))
    assert single[0].outputs[0].token_ids == ids[0].outputs[0].token_ids
    out = tiny_llm.generate([[1, 5, 6], "xy"], [SamplingParams(temperature=0, max_tokens=2),
                                                  SamplingParams(temperature=0, max_tokens=4)])
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 4]
    assert len(tiny_llm.generate("x")[0].outputs[0].token_ids) <= 16      # default SamplingParams


@pytest.mark.parametrize("prompts, params, words", [
    ([], None, "empty"),
    (["a", "b"], [SamplingParams()], "2 prompts"),
    ([[1, 2], [1, 5000]], None, "vocabulary"),
    ([[1, 2], [1, 2]], [SamplingParams(), SamplingParams(max_tokens=500)], "prompt 1: .*max_model_len"),
    ([[1, 2], []], None, "prompt 1: .*empty"),
    ([{"x": 1}], None, "string or a list of token ids"),
    (["a"], ["not params"], "SamplingParams"),
])
def test_bad_requests_raise_and_leave_nothing_running(tiny_llm, prompts, params, words):
    with pytest.raises(RequestError, match=words):
        tiny_llm.generate(prompts, params)
    assert not tiny_llm.engine.has_unfinished()
    assert tiny_llm.cache_stats().used_units == 0


def test_unknown_config_key_is_a_config_error():
    with pytest.raises(ConfigError, match="nonsense"):
        LLM("tiny", backend="paged", nonsense=1)


def test_metrics_and_stats_are_json(tiny_llm):
    tiny_llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    m = tiny_llm.metrics()
    blob = json.loads(json.dumps(m.to_dict()))
    assert blob["output_tokens"] == 18 and blob["backend"] == "paged"
    assert m.kernels["decode"] and m.output_tokens_per_s > 0 and m.allocator_seconds >= 0
    assert json.dumps(tiny_llm.cache_stats().to_dict())


def test_string_prompt_without_tokenizer_is_rejected(small_vocab_model):
    engine = small_engine(small_vocab_model, "paged")
    with pytest.raises(RequestError, match="no tokenizer"):
        engine.add_request("hello")


# -- threads and the lifecycle (issue 20: items 1, 6 and 10) -----------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
THREAD_PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10], [11]]


@pytest.fixture(scope="module")
def shared_llms():
    """One LLM per backend, with the single-threaded greedy answer for every THREAD_PROMPTS prompt."""
    llms = {b: LLM("tiny", backend=b, check_invariants=True, reserve_mode="oracle", **SMALL) for b in BACKENDS}
    want = {b: [o.outputs[0].token_ids for o in llm.generate(THREAD_PROMPTS, GREEDY)] for b, llm in llms.items()}
    yield llms, want
    for llm in llms.values():
        llm.close()


@settings(max_examples=6, deadline=None)
@given(backend=st.sampled_from(BACKENDS), threads=st.integers(2, 4),
       picks=st.lists(st.lists(st.integers(0, len(THREAD_PROMPTS) - 1), min_size=1, max_size=3),
                      min_size=4, max_size=4))
def test_concurrent_generate_gets_correct_outputs_or_a_clean_request_error(shared_llms, backend, threads, picks):
    llms, want = shared_llms
    llm, barrier, results = llms[backend], threading.Barrier(threads), [None] * threads

    def call(t: int) -> None:
        barrier.wait()
        try:
            results[t] = [o.outputs[0].token_ids for o in llm.generate([THREAD_PROMPTS[i] for i in picks[t]],
                                                                       GREEDY)]
        except RequestError as exc:
            results[t] = exc

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                  # switch threads as often as possible
    try:
        workers = [threading.Thread(target=call, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
    finally:
        sys.setswitchinterval(interval)
    for t, got in enumerate(results):
        if isinstance(got, RequestError):
            assert "another generate() is running" in str(got)
        else:
            assert got == [want[backend][i] for i in picks[t]], f"thread {t} got wrong tokens"
    assert not llm.engine.has_unfinished()
    assert llm.cache_stats().used_units == 0
    assert llm.generate(THREAD_PROMPTS[0], GREEDY)[0].outputs[0].token_ids == want[backend][0]


def test_a_bad_prompt_after_a_good_one_leaves_the_llm_usable(tiny_llm):
    with pytest.raises(RequestError, match="prompt 1: .*surrogate"):
        tiny_llm.generate(["ok", "\ud800"], GREEDY)
    assert not tiny_llm.engine.has_unfinished() and tiny_llm.cache_stats().used_units == 0
    assert len(tiny_llm.generate(["ok"], GREEDY)[0].outputs[0].token_ids) == 4


def test_any_error_while_adding_prompts_is_cleaned_up(tiny_llm, monkeypatch):
    real = engine_module.prompt_tokens

    def tokenize(prompt, *args):
        if prompt == "boom":
            raise RuntimeError("tokenizer broke")
        return real(prompt, *args)

    monkeypatch.setattr(engine_module, "prompt_tokens", tokenize)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        tiny_llm.generate(["ok", "fine", "boom"], GREEDY)
    assert not tiny_llm.engine.has_unfinished() and tiny_llm.cache_stats().used_units == 0
    assert len(tiny_llm.generate(["ok"], GREEDY)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_after_close_is_a_clear_error(backend):
    llm = LLM("tiny", backend=backend, reserve_mode="oracle", **SMALL)
    llm.generate([[1, 2, 3]], GREEDY)
    llm.close()
    with pytest.raises(KvlabError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY)
    with pytest.raises(KvlabError, match="closed"):
        llm.engine.step()
    llm.close()                                  # twice is harmless


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_from_another_thread_stops_the_run_with_a_clear_error(backend, monkeypatch):
    llm = LLM("tiny", backend=backend, reserve_mode="oracle", **SMALL)
    stepped, real_step, caught = threading.Event(), llm.engine.step, []

    def step():
        stepped.set()
        return real_step()

    def run_long() -> None:
        try:
            llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        except BaseException as exc:             # noqa: BLE001 - the test inspects what came out
            caught.append(exc)

    monkeypatch.setattr(llm.engine, "step", step)
    worker = threading.Thread(target=run_long)
    worker.start()
    assert stepped.wait(60)
    llm.close()                                  # waits for the run to stop, then releases the cache
    worker.join(60)
    assert len(caught) == 1 and type(caught[0]) is KvlabError and "closed" in str(caught[0]), caught
    assert llm.engine.closed


def test_an_llm_on_a_pool_dropped_without_close_leaves_nothing_once_collected():
    """Its memfd mappings, its steward and mapper threads and its pool membership go when it is collected."""
    import gc
    import uuid

    from helpers.invariants import kvlab_threads

    from kvlab.vmm import pool
    with pool.create(f"drop-{uuid.uuid4().hex[:8]}", 8 << 20, page_size=4096) as holder:
        threads, maps = kvlab_threads(), open("/proc/self/maps").read().count("memfd:kvlab-pool")   # the holder's
        llm = LLM("tiny", backend="vmm", kv_pool=holder.name, background_mapping=True, **SMALL)
        llm.generate([[1, 2, 3]], GREEDY)
        assert len(holder.status().engines) == 2 and kvlab_threads() - threads
        del llm
        gc.collect()
        assert len(holder.status().engines) == 1 and holder.status().used == 0
        assert not kvlab_threads() - threads
        assert open("/proc/self/maps").read().count("memfd:kvlab-pool") == maps


# -- stop conditions ---------------------------------------------------------------------------------------

@torch.inference_mode()
def reference_greedy(model, prompt, max_tokens, stop) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model.reference_forward(torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] in stop:
            break
    return ids[len(prompt):]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eos_and_stop_tokens(small_vocab_model, backend):
    engine = small_engine(small_vocab_model, backend)
    prompts = [[1, 3, 4], [1, 4], [1, 5]]          # the first two reach EOS within 20 greedy tokens
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=20), "eos")
    engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "ignore")
    engine.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[5, 6]),
                       "stop")
    out = run(engine)
    eos = reference_greedy(small_vocab_model, prompts[0], 20, {EOS})
    assert out["eos"].outputs[0].token_ids == eos and eos[-1] == EOS
    assert out["eos"].outputs[0].finish_reason == "stop"
    ignored = out["ignore"].outputs[0].token_ids
    assert ignored == reference_greedy(small_vocab_model, prompts[1], 20, set()) and EOS in ignored[:-1]
    stop = reference_greedy(small_vocab_model, prompts[2], 20, {EOS, 5, 6})
    assert out["stop"].outputs[0].token_ids == stop and stop[-1] in {EOS, 5, 6}
    assert engine.cache_stats().used_units == 0


# -- beam search -------------------------------------------------------------------------------------------

@torch.inference_mode()
def brute_force_beam(model, prompt, width, max_tokens, stop, n):
    """The beam semantics of common/sched/beam.py, re-implemented over cache-free full forwards."""
    def logprobs(tokens):
        return torch.log_softmax(model.reference_forward(torch.tensor([prompt + tokens]))[0, -1], -1).tolist()

    live, hyps = [(0.0, [])], []
    for step in range(max_tokens):
        cands = []
        for b, (score, toks) in enumerate(live):
            lp = logprobs(toks)
            best = sorted(range(VOCAB), key=lambda t: -lp[t])[:2 * width]
            cands += [(score + lp[t], b, rank, t) for rank, t in enumerate(best)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        new = []
        for pos, (score, b, _, t) in enumerate(cands):
            if t in stop:
                if pos < width:
                    hyps.append((score, live[b][1] + [t]))
                continue
            new.append((score, live[b][1] + [t]))
            if len(new) == width:
                break
        if step + 1 == max_tokens:
            hyps += new
            new = []
        if len(hyps) >= width and new and new[0][0] <= sorted(h[0] for h in hyps)[-width]:
            new = []
        live = new
        if not live:
            break
    return sorted(hyps, key=lambda h: -h[0])[:n]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width, ignore_eos", [(2, False), (4, False), (3, True)])
def test_beam_search_equals_brute_force(small_vocab_model, backend, width, ignore_eos):
    engine = small_engine(small_vocab_model, backend)
    prompts = [[1, 4], [1, 6, 3, 7, 5], [1, 3, 3]]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(beam_width=width, n=2, max_tokens=6, ignore_eos=ignore_eos),
                           str(i))
    out = run(engine)
    stop = set() if ignore_eos else {EOS}
    for i, prompt in enumerate(prompts):
        want = brute_force_beam(small_vocab_model, prompt, width, 6, stop, 2)
        got = out[str(i)].outputs
        assert [c.token_ids for c in got] == [toks for _, toks in want]
        assert [c.cumulative_logprob for c in got] == pytest.approx([s for s, _ in want], abs=1e-4)
    assert engine.cache_stats().used_units == 0


@pytest.mark.parametrize("backend", ["paged", "vmm"])
def test_wide_beam_finds_the_global_optimum(small_vocab_model, backend):
    """beam_width = V^(L-1) prunes nothing before the last step: the best beam is the best of all V^L."""
    prompt, length = [1, 5, 3], 3
    engine = small_engine(small_vocab_model, backend)
    width = VOCAB ** (length - 1)
    engine.add_request(prompt, SamplingParams(beam_width=width, max_tokens=length, ignore_eos=True))
    best = run(engine)["0"].outputs[0]
    seqs = torch.tensor([prompt + list(s) for s in itertools.product(range(VOCAB), repeat=length)])
    with torch.inference_mode():
        lp = torch.log_softmax(small_vocab_model.reference_forward(seqs), -1)
    p = len(prompt)
    scores = sum(lp[:, p - 1 + j].gather(1, seqs[:, p + j, None])[:, 0] for j in range(length))
    top = int(scores.argmax())
    assert best.token_ids == seqs[top, len(prompt):].tolist()
    assert best.cumulative_logprob == pytest.approx(float(scores[top]), abs=1e-4)
    assert engine.cache_stats().used_units == 0


@pytest.mark.parametrize("backend, tokens", [("paged", 80), ("vmm", 256)])   # vmm: 64-token pages
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_preemption(small_vocab_model, backend, tokens, mode):
    """A budget too small for the beams and another request at once: beams are preempted (one at a time, newest
    first: the others keep sharing their KV) and the search still gives the same result."""
    prompt = [1, 6, 3, 7, 5, 4, 4, 3]
    params = SamplingParams(beam_width=4, n=4, max_tokens=10, ignore_eos=True)
    roomy = small_engine(small_vocab_model, backend)
    roomy.add_request(prompt, params)
    want = run(roomy)["0"].outputs
    tight = small_engine(small_vocab_model, backend, kv_cache_bytes=tokens * 256, preemption_mode=mode)
    tight.add_request(prompt, params)
    tight.add_request([1, 3, 5, 7] * 5, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    out = run(tight)
    assert [c.token_ids for c in out["0"].outputs] == [c.token_ids for c in want]
    assert out["0"].metrics.num_preemptions >= 1                    # the beams themselves were preempted
    assert tight.cache_stats().used_units == 0


@pytest.mark.parametrize("backend", ["paged", "vmm"])
def test_beams_that_cannot_fit_at_once_take_turns(small_vocab_model, backend):
    """Four beams need four private pages once they diverge; one 64-token vmm page (or 16 blocks of 4 that
    lose their sharing when preempted) cannot hold them at once. A beam that has proposed its candidates keeps
    them and releases its KV, so the beams take turns: the search completes with the result of a roomy cache,
    and the other request completes too."""
    prompt, params = [1, 6, 3, 7, 5, 4, 4, 3], SamplingParams(beam_width=4, max_tokens=10, ignore_eos=True)
    roomy = small_engine(small_vocab_model, backend)
    roomy.add_request(prompt, params)
    want = run(roomy)["0"].outputs
    tight = small_engine(small_vocab_model, backend, kv_cache_bytes=64 * 256)
    tight.add_request(prompt, params)
    tight.add_request([1, 3, 5, 7] * 5, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    out = run(tight)
    assert out["0"].error is None and [c.token_ids for c in out["0"].outputs] == [c.token_ids for c in want]
    assert out["1"].error is None and len(out["1"].outputs[0].token_ids) == 12
    assert tight.scheduler_stats().idle_beam_releases > 0
    assert tight.cache_stats().used_units == 0


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "kvlab.toml"
    path.write_text('[engine]\nbackend = "reserve"\nreserve_mode = "oracle"\nmax_model_len = 64\n')
    with LLM(config_file=str(path), kv_cache_bytes=256 * 4096) as llm:
        assert (llm.config.model, llm.config.backend, llm.config.max_model_len) == ("tiny", "reserve", 64)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) <= 4 and llm.cache_stats().backend == "reserve"
