"""kvlab serve speaks vLLM's OpenAI dialect for a text model, driven by clients kvlab did not write: the openai SDK
(completions and chat) and huggingface_hub's InferenceClient (chat), streamed and not, content as a string and
as parts; plus the fields and endpoints beyond the basics, checked over plain HTTP."""
from __future__ import annotations

import math

import httpx
import pytest
from helpers.lazy import LazyImport
from helpers.servers import LiveServer, greedy

from kvlab import LLM, SamplingParams

openai = LazyImport("openai")                    # dev dependencies (pyproject [dev])
hf_hub = pytest.importorskip("huggingface_hub")
PARTS = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]


@pytest.fixture(scope="module")
def live():
    s = LiveServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    llm = LLM(model="tiny", backend="vmm")
    yield llm
    llm.close()


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=60)


# -- foreign clients ------------------------------------------------------------------------------------------
def test_openai_sdk_chat_content_as_parts_equals_string(live):
    c = live.client()
    as_string = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello\nthere"}],
                                          max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    as_parts = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PARTS}],
                                         max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.completion_tokens == 6


def test_openai_sdk_streams_with_usage_in_every_chunk(live):
    c = live.client()
    chunks = list(c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PARTS}], stream=True, **greedy(5),
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(ch.usage is not None for ch in chunks)
    assert chunks[-1].usage.completion_tokens == 5
    plain = list(c.completions.create(model="tiny", prompt="abc", stream=True, **greedy(5)))
    assert all(ch.usage is None for ch in plain)


def test_openai_sdk_completion_logprobs_are_the_engines(live, reference):
    c = live.client()
    served = c.completions.create(model="tiny", prompt="kv cache", logprobs=3, **greedy(6))
    offline = reference.generate(["kv cache"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                              logprobs=3))[0].outputs[0]
    lp = served.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[0] for e in offline.logprobs], abs=1e-5)
    for k, (chosen, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        best = offline.logprobs[k][1]
        assert len(best) == 3 and best[0] == (offline.token_ids[k], pytest.approx(chosen, abs=1e-5))   # greedy
        assert sorted(top.values()) == pytest.approx(sorted({v for _, v in best}), abs=1e-5) \
            or len(top) < 3                                  # byte tokens may decode alike ("\ufffd")
    assert math.isclose(sum(lp.token_logprobs), offline.cumulative_logprob, abs_tol=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert "".join(lp.tokens) == served.choices[0].text


def test_openai_sdk_chat_logprobs_streamed_equal_plain(live):
    c = live.client()
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
              **greedy(5))
    plain = c.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw)
                for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in plain]
    assert len(plain) == 5 and all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode())
                                   for e in plain)


def test_huggingface_hub_client_chat_streamed_and_not(live):
    client = hf_hub.InferenceClient(base_url=live.url + "/v1", api_key="none", timeout=60)
    messages = [{"role": "user", "content": PARTS}]
    plain = client.chat_completion(messages, model="tiny", max_tokens=6, temperature=0, seed=3)
    streamed = "".join(ch.choices[0].delta.content or ""
                       for ch in client.chat_completion(messages, model="tiny", max_tokens=6, temperature=0,
                                                        seed=3, stream=True) if ch.choices)
    assert plain.choices[0].message.content == streamed
    assert plain.usage.completion_tokens <= 6


# -- fields ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "best_of": -1}, "best_of"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": -3}, "logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": 2**64 - 1}, "seed"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "user": 5}, "user"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}}, "continuous_usage_stats"),
])
def test_fields_kvlab_cannot_take_are_a_400_naming_them(live, body, param):
    r = post(live, "/v1/completions", {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
])
def test_chat_fields_kvlab_cannot_take_are_a_400_naming_them(live, body, param):
    r = post(live, "/v1/chat/completions", {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]


def test_unknown_model_is_404_and_neutral_values_are_accepted(live):
    r = post(live, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    ok = post(live, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "me",
                                        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                                        "best_of": 1, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text


def test_penalties_change_greedy_text_as_vllm_defines_them(live):
    body = {"model": "tiny", "prompt": "aaaa", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    base = post(live, "/v1/completions", body).json()["choices"][0]["token_ids"]
    assert len(set(base)) < len(base)                       # the tiny model repeats itself
    strong = post(live, "/v1/completions", dict(body, frequency_penalty=2.0, presence_penalty=2.0,
                                                repetition_penalty=2.0)).json()["choices"][0]["token_ids"]
    assert strong != base
    assert len(set(strong)) > len(set(base))


def test_echo_leads_with_the_prompt_streamed_and_not(live):
    body = {"model": "tiny", "prompt": "echo me", "echo": True, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    plain = post(live, "/v1/completions", body).json()["choices"][0]["text"]
    assert plain.startswith("echo me") and len(plain) > len("echo me")
    c = live.client()
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="echo me", echo=True, stream=True, **greedy(4)) if ch.choices)
    assert streamed == plain


def test_tokenize_detokenize_version(live):
    tokens = post(live, "/tokenize", {"model": "tiny", "prompt": "hello"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert post(live, "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]}).json() == {"prompt": "hello"}
    chat = post(live, "/tokenize", {"messages": [{"role": "user", "content": PARTS}]}).json()
    assert chat["count"] > tokens["count"]
    assert post(live, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert post(live, "/tokenize", {"model": "gpt-4", "prompt": "x"}).status_code == 404
    assert httpx.get(live.url + "/version").json()["version"]
