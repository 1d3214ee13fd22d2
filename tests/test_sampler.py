"""Sampler and SamplingParams: greedy, temperature, top-k, top-p, seeds, beam candidates, validation."""
from __future__ import annotations

import math

import pytest
import torch

from kvlab import LLM
from kvlab.common.errors import RequestError
from kvlab.common.request import SampleSpec
from kvlab.common.sampler import Sampler, apply_penalties, apply_top_k_top_p
from kvlab.common.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])


def spec(n=1, beam=False, generators=None, **kw) -> SampleSpec:
    return SampleSpec(SamplingParams(**kw), n, generators, beam)


def draw(sampler, logits, s) -> list[int]:
    return [tok for tok, _ in sampler(logits, [s])[0]]


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(n=0), "n must"),
    (dict(n=1.5), "n must"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(seed="x"), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(beam_width=0), "beam_width"),
    (dict(beam_width=2, n=3, temperature=0), "n=3 > beam_width=2"),
    (dict(beam_width=2, top_k=5), "deterministic"),
    (dict(beam_width=2, seed=1), "deterministic"),
    (dict(beam_width=2, temperature=0.7), "temperature"),
])
def test_invalid_params_raise_one_clear_line(kwargs, words):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert words in message and "\n" not in message


def test_valid_params():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy
    assert SamplingParams(beam_width=4, n=2).width == 4
    assert SamplingParams(n=3).width == 3


def test_greedy_is_argmax_with_model_logprob():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [spec(temperature=0)] * 5)
    logprobs = torch.log_softmax(logits, -1)
    for row, samples in enumerate(out):
        (tok, lp), = samples
        assert tok == int(logits[row].argmax())
        assert lp == pytest.approx(float(logprobs[row, tok]), abs=1e-6)


def test_temperature_sampling_follows_softmax():
    n, temperature = 40_000, 0.8
    tokens = torch.tensor(draw(Sampler(1), LOGITS, spec(n, temperature=temperature)))
    freq = torch.bincount(tokens, minlength=8).float() / n
    expected = torch.softmax(LOGITS[0] / temperature, -1)
    assert torch.allclose(freq, expected, atol=0.012), (freq, expected)


def test_top_k_only_samples_the_k_best():
    tokens = set(draw(Sampler(2), LOGITS, spec(4000, temperature=2.0, top_k=3)))
    assert tokens == {0, 6, 1}          # logits 2.0, 1.5, 1.0


def test_top_p_keeps_the_nucleus():
    probs = torch.softmax(LOGITS[0], -1)
    order = probs.argsort(descending=True).tolist()
    top_p = float(probs[order[0]] + probs[order[1]]) - 1e-3     # needs the two best tokens
    tokens = set(draw(Sampler(3), LOGITS, spec(4000, top_p=top_p)))
    assert tokens == set(order[:2])


def test_apply_top_k_top_p_masks_in_place_of_sorting():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert torch.isinf(out[1]).tolist() == [False, True, True, True]   # 5.0 alone holds > 50%


def test_seeded_rows_ignore_the_batch_around_them():
    seeded = spec(3, temperature=1.0, generators=[torch.Generator().manual_seed(7 + i) for i in range(3)])
    alone = draw(Sampler(0), LOGITS, seeded)
    seeded2 = spec(3, temperature=1.0, generators=[torch.Generator().manual_seed(7 + i) for i in range(3)])
    logits = torch.cat([torch.randn(2, 8), LOGITS, torch.randn(1, 8)])
    others = [spec(temperature=1.0), spec(2, temperature=0.5)]
    crowd = Sampler(99)(logits, [*others, seeded2, spec(temperature=0)])
    assert [t for t, _ in crowd[2]] == alone


def test_unseeded_rows_follow_the_sampler_seed():
    a = draw(Sampler(5), LOGITS, spec(50))
    b = draw(Sampler(5), LOGITS, spec(50))
    c = draw(Sampler(6), LOGITS, spec(50))
    assert a == b and a != c


def test_beam_candidates_are_the_best_logprobs_in_order():
    out = Sampler()(LOGITS, [spec(4, beam=True, beam_width=2)])[0]
    logprobs = torch.log_softmax(LOGITS[0], -1)
    assert [t for t, _ in out] == logprobs.argsort(descending=True)[:4].tolist()
    assert all(math.isclose(lp, float(logprobs[t]), abs_tol=1e-6) for t, lp in out)


def test_beam_candidates_capped_by_vocab():
    out = Sampler()(LOGITS, [spec(16, beam=True, beam_width=8)])[0]
    assert len(out) == 8 and len({t for t, _ in out}) == 8


def test_mixed_batch_keeps_row_order():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    specs = [spec(temperature=0), spec(3, beam=True, beam_width=2), spec(2, temperature=1.0), spec(top_k=1)]
    out = Sampler()(logits, specs)
    assert out[0][0][0] == int(logits[0].argmax()) and out[3][0][0] == int(logits[3].argmax())
    assert [t for t, _ in out[1]] == logits[1].topk(3).indices.tolist()
    assert len(out[2]) == 2


class Seen:
    """A sequence's history as the penalties read it."""

    def __init__(self, token_ids: list[int], prompt_len: int) -> None:
        self.token_ids, self.prompt_len = token_ids, prompt_len


def test_penalties_follow_vllms_definitions():
    # prompt [1], output [0, 0, 5]: token 0 twice, token 5 (negative logit) once, token 1 seen in the prompt only
    history = Seen([1, 0, 0, 5], 1)
    s = spec(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = apply_penalties(LOGITS, [0], [s], [history])[0]
    expected = LOGITS[0].clone()
    expected[0] = 2.0 / 2 - 0.25 * 2 - 0.5
    expected[1] = 1.0 / 2                                  # prompt tokens: repetition only
    expected[5] = -3.0 * 2 - 0.25 - 0.5
    assert torch.allclose(out, expected)
    assert torch.equal(LOGITS, torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]]))   # not in place


def test_greedy_under_penalties_picks_the_penalized_best_but_reports_the_models_logprob():
    token, lp = Sampler()(LOGITS, [spec(temperature=0, frequency_penalty=2.0)], [Seen([7, 0, 0], 1)])[0][0]
    assert token == 6                                      # 2.0 - 4 < 1.5
    assert lp == pytest.approx(torch.log_softmax(LOGITS, -1)[0, 6].item())


def test_logprobs_add_the_top_candidates_only_to_rows_that_ask():
    asking, plain = Sampler()(LOGITS.repeat(2, 1), [spec(temperature=0, logprobs=3), spec(temperature=0)])
    logprobs = torch.log_softmax(LOGITS, -1)[0]
    token, lp, top = asking[0]
    assert token == 0 and [t for t, _ in top] == [0, 6, 1]
    assert [v for _, v in top] == pytest.approx(logprobs[[0, 6, 1]].tolist())
    assert len(plain[0]) == 2                              # (token, logprob): nothing computed for it


@pytest.mark.parametrize("kwargs, words", [
    (dict(logprobs=-3), "logprobs"), (dict(logprobs=21), "logprobs"), (dict(presence_penalty=2.5), "presence"),
    (dict(frequency_penalty=float("nan")), "frequency"), (dict(repetition_penalty=0), "repetition"),
    (dict(seed=-1), "seed"), (dict(seed=2**64 - 1), "seed"),
    (dict(beam_width=2, logprobs=1), "beam search"), (dict(beam_width=2, repetition_penalty=1.2), "beam search"),
])
def test_logprobs_penalties_and_seed_are_validated(kwargs, words):
    with pytest.raises(RequestError, match=words):
        SamplingParams(**kwargs)


def test_parallel_samples_each_carry_their_own_token_logprobs():
    llm = LLM(model="tiny", backend="paged")
    try:
        out = llm.generate(["abc"], SamplingParams(n=3, max_tokens=5, seed=1, logprobs=2, ignore_eos=True))[0]
        plain = llm.generate(["abc"], SamplingParams(n=3, max_tokens=5, seed=1, ignore_eos=True))[0]
    finally:
        llm.close()
    for c, p in zip(out.outputs, plain.outputs):
        assert c.token_ids == p.token_ids and p.logprobs is None      # asking changes nothing it samples
        assert len(c.logprobs) == 5 and all(len(top) == 2 for _, top in c.logprobs)
        assert sum(lp for lp, _ in c.logprobs) == pytest.approx(c.cumulative_logprob, abs=1e-5)
