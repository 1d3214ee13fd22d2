"""An HTTP fuzzer driven by the server's own OpenAPI document (/openapi.json, experiments/serve/schema.py): bodies
drawn from each POST schema, and from its hostile neighbourhood (every field given any JSON value), must never
get a 5xx; every error is OpenAI-shaped; /health answers 200 after every case. A few dozen cases in `make test`,
a thousand under `-m slow`.

The schemas are drawn by `from_schema` below, not by hypothesis-jsonschema: its 0.23.1 (the newest) calls a
Hypothesis internal (`conjecture.utils.many`) that the installed Hypothesis no longer has, for any object schema."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
from helpers.servers import LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.experiments.limits import MAX_N, MAX_TOKENS

SIZES = ("n", "max_tokens", "max_completion_tokens")       # bounded in every case, so each case takes milliseconds
SURROGATES = st.sampled_from(["a\ud800b", "\udfff", "\x00"])            # not valid UTF-8; NUL
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | SURROGATES,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                    max_size=3), max_leaves=8)
HOSTILE_SIZE = st.integers(-3, 4) | st.sampled_from([MAX_N + 1, MAX_TOKENS + 1, 2**64]) | JSON
# round 4: integers beyond a float, and values far longer than an error message may quote
HUGE = st.sampled_from([10**400, -(10**400), 2**63, 2**64 + 1, 1e308, "x" * 100_000, ["y" * 100_000],
                        {"z" * 100_000: 1}])
MAX_MESSAGE_CHARS = 1000


@pytest.fixture(scope="module")
def live():
    s = LiveServer()
    yield s
    s.stop()


def post_bodies(live) -> dict[str, dict]:
    doc = httpx.get(live.url + "/openapi.json", timeout=10).json()
    return {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
            for path, ops in doc["paths"].items() if "post" in ops}


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values valid under the subset of JSON Schema that schema.py uses."""
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = {k: from_schema(v) for k, v in schema.get("properties", {}).items()}
        required = {k: props.pop(k) for k in schema.get("required", [])}
        return st.fixed_dictionaries(required, optional=props)
    if kind == "array":
        return st.lists(from_schema(schema["items"]), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 8))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 40))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)
    return st.just(None) if kind == "null" else st.booleans()


def quick(schema: dict) -> dict:
    """The schema with small sizes: the draws stay valid and fast."""
    schema = copy.deepcopy(schema)
    props = schema["properties"]
    for name in SIZES:
        if name in props:
            props[name]["maximum"] = 4
    for name in ("prompt", "messages"):
        if name in props:
            forms = props[name].get("anyOf", [props[name]])
            props[name] = {"anyOf": [dict(form, maxLength=40, maxItems=4) for form in forms]}
    return schema


def hostile(schema: dict) -> st.SearchStrategy[dict]:
    """Any subset of the schema's fields, each with any JSON value (the sizes stay small or out of range)."""
    values = {name: HOSTILE_SIZE if name in SIZES else JSON | HUGE for name in schema["properties"]}
    return st.fixed_dictionaries({}, optional=values)


def requests(live) -> st.SearchStrategy[tuple[str, dict]]:
    return st.one_of([st.tuples(st.just(path), from_schema(quick(schema)) | hostile(schema))
                      for path, schema in post_bodies(live).items()])


def check_case(live, path: str, body: dict) -> None:
    r = httpx.post(live.url + path, content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str) and "param" in err, r.text
        assert len(err["message"]) <= MAX_MESSAGE_CHARS and "\n" not in err["message"], err["message"][:300]
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def fuzz(live, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests(live))
    def case(request: tuple[str, dict]) -> None:
        check_case(live, *request)
    case()


def test_the_schema_describes_both_bodies(live):
    bodies = post_bodies(live)
    assert bodies["/v1/completions"]["required"] == ["prompt"]
    assert bodies["/v1/chat/completions"]["required"] == ["messages"]


def test_fuzz_the_api_briefly(live):
    fuzz(live, 40)


@pytest.mark.slow
def test_fuzz_the_api_at_length(live):
    fuzz(live, 1000)


# Round 4's surfaces, each body once: numbers beyond a float in every float field, long values in every field
# whose error quotes it, /tokenize and /detokenize (ids outside the vocabulary), and kv_transfer_params with the
# first token's logprob in every wrong shape. Every one must be answered below 500 in one short line.
FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
LONG = "w" * 4_000_000
ROUND4 = [
    *[("/v1/completions", {"prompt": "hi", name: sign * 10**400}) for name in FLOATS for sign in (1, -1)],
    *[("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], name: 10**400}) for name in FLOATS],
    *[("/v1/completions", {"prompt": "hi", name: LONG}) for name in ("stream", "echo", "user", "model", "n", "seed",
                                                                      "stop", "logprobs", "best_of", "top_k")],
    ("/v1/completions", {"prompt": "hi", "logit_bias": {LONG: 1}}),
    ("/v1/completions", {"prompt": "hi", "stream_options": [LONG]}),
    ("/v1/chat/completions", {"messages": [{"role": LONG}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": LONG}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": [LONG]}]}]}),
    ("/tokenize", {"prompt": [LONG]}), ("/tokenize", {"messages": LONG}), ("/tokenize", LONG),
    *[("/detokenize", {"tokens": t}) for t in ([1259], [2**31], [2**63], [10**30], [10**400], [-1], LONG, [LONG],
                                                 [True], [1.5], None)],
    *[("/v1/completions", {"prompt": "hi", "kv_transfer_params": {
        "do_remote_prefill": True, "handoff_id": "a", "address": "kvlab-handoff-x", "num_tokens": 2,
        "first_token_ids": [5], "backend": "vmm", "pool": None, "first_token_logprob": v}})
      for v in ([0.5, []], [-1, [[5, 0.5]]], [-1, [[2**70, -1]]], [10**400, []], [-1, [[5]] * 30], "x", [LONG])],
]


def test_round4_hostile_bodies_are_all_handled(live):
    handled = 0
    for path, body in ROUND4:
        r = httpx.post(live.url + path, content=json.dumps(body), timeout=60,
                       headers={"content-type": "application/json"})
        message = r.json()["error"]["message"] if r.status_code >= 400 else ""
        handled += r.status_code < 500 and len(message) <= MAX_MESSAGE_CHARS and "\n" not in message
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    assert handled == len(ROUND4), f"{handled} of {len(ROUND4)} handled"
