"""The OpenAI request schema kvlab serves: a JSON body -> one validated `Submission`, or an `ApiError`.

The fields read are those below; a field kvlab cannot honour (UNSUPPORTED) is a 400 naming it unless it holds
its neutral value, a known field with a wrong type or value is a 400 naming it, and any other field is ignored
(as OpenAI clients send extras). docs/serving.md has the table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvlab.common.errors import RequestError
from kvlab.common.limits import MAX_SEED
from kvlab.common.sampling_params import MAX_LOGPROBS, SamplingParams
from kvlab.common.validate import as_finite, shown
from kvlab.experiments.limits import MAX_N, MAX_PROMPT_CHARS, MAX_STOP_CHARS, MAX_TOKENS, MAX_VOCAB

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
MAX_TRANSFER_PARAMS_CHARS = 4096   # kv_transfer_params as JSON: a handful of short fields
# kv_transfer_params (vLLM's field for disaggregated serving, docs/disaggregation.md): the fields kvlab reads, by
# the JSON type each must have; others are ignored, as vLLM's connectors ignore each other's
TRANSFER_FIELDS = {"do_remote_decode": (bool,), "do_remote_prefill": (bool,), "handoff_id": (str,),
                   "address": (str,), "backend": (str,), "pool": (str, type(None)), "num_tokens": (int,),
                   "first_token_ids": (list,), "first_token_logprob": (list,)}

# Fields kvlab cannot honour, with the value that asks for nothing (sent by many clients, so accepted).
UNSUPPORTED = {
    "logit_bias": {}, "suffix": "",
    "tools": [], "tool_choice": "none", "functions": [], "function_call": "none", "min_tokens": 0,
    "response_format": {"type": "text"}, "guided_json": None, "guided_regex": None, "guided_choice": None,
}


class ApiError(Exception):
    """An error returned to the client as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code if self.code is not None else str(self.status)}}


@dataclass(slots=True)
class Submission:
    """One parsed request: what the engine thread needs plus what the response writer needs."""
    prompt: str | list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    model: str = ""
    continuous_usage: bool = False      # usage in every streamed chunk (vLLM's continuous_usage_stats)
    echo: bool = False                  # completions: the prompt text leads each choice
    kv_transfer_params: dict[str, Any] | None = None   # disaggregated serving: passed to the engine as given


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


def _int(body: dict, name: str, default: Any, low: int | None = None, high: int | None = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or (low is not None and v < low):
        raise bad(name, f"must be an integer{'' if low is None else f' >= {low}'}, got {shown(v)}")
    if high is not None and v > high:
        raise bad(name, f"must be at most {high:,} (the server's limit), got {shown(v)}")
    return v


def _float(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    number = as_finite(v)                 # None for an integer beyond the float range, as for NaN and inf
    if number is None:
        raise bad(name, f"must be a finite number, got {shown(v)}")
    return number


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {shown(v)}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS}, got {shown(v)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"a stop string may have at most {MAX_STOP_CHARS:,} characters")
    return stops


def _stream_usage(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous): usage in a last chunk, and (both set, as vLLM) in every chunk."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise bad("stream_options", f"must be an object, got {shown(opts)}")
    if not stream:
        raise bad("stream_options", "is only allowed with stream=true")
    usage, continuous = _bool(opts, "include_usage", False), _bool(opts, "continuous_usage_stats", False)
    return usage, usage and continuous


def _kv_transfer_params(body: dict) -> dict[str, Any] | None:
    """The object's shape only (each field the engine reads has its JSON type); what the values mean is the
    engine's to check (a 400 from add_request)."""
    v = body.get("kv_transfer_params")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("kv_transfer_params", f"must be an object, got {shown(v)}")
    if len(json.dumps(v)) > MAX_TRANSFER_PARAMS_CHARS:
        raise bad("kv_transfer_params", f"may have at most {MAX_TRANSFER_PARAMS_CHARS:,} characters as JSON")
    for name, types in TRANSFER_FIELDS.items():
        if name in v and not _is(v[name], types):
            kind = " or ".join("null" if t is type(None) else TYPE_NAMES[t] for t in types)
            raise bad("kv_transfer_params", f"{name} must be {kind}, got {shown(v[name])}")
    ids = v.get("first_token_ids", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_VOCAB for t in ids):
        raise bad("kv_transfer_params", f"first_token_ids must be token ids, got {shown(ids)}")
    return v


TYPE_NAMES = {bool: "true or false", str: "a string", int: "an integer", list: "a list"}


def _is(value: Any, types: tuple[type, ...]) -> bool:
    """isinstance, but a bool is no integer."""
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v != neutral:
            raise bad(name, f"kvlab does not support it (only {neutral!r} is accepted), got {shown(v)}")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top candidates each token reports (None: no logprobs). Chat: logprobs (bool) + top_logprobs;
    completions: logprobs (int). Both bounded by MAX_LOGPROBS, as vLLM's default max_logprobs."""
    name = "top_logprobs" if chat else "logprobs"
    top = _int(body, name, None, low=0)
    if top is not None and top > MAX_LOGPROBS:
        raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {shown(top)}")
    if not chat:
        return top
    if not _bool(body, "logprobs", False):
        if top is not None:
            raise bad("top_logprobs", "needs logprobs=true")
        return None
    return top or 0


def _best_of(body: dict, n: int) -> None:
    best_of = _int(body, "best_of", None, low=1)
    if best_of is not None and best_of < n:
        raise bad("best_of", f"must be >= n ({n}), got {shown(best_of)}")
    if best_of is not None and best_of != n:
        raise bad("best_of", "kvlab returns every sample it draws: only best_of == n is supported, got "
                             f"{shown(best_of)}")


def _user(body: dict) -> None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"must be a string, got {shown(user)}")


def _seed(body: dict) -> int | None:
    seed = _int(body, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad("seed", f"must be an integer in [0, {MAX_SEED}], got {shown(seed)}")
    return seed


def sampling_params(body: dict, chat: bool = False) -> SamplingParams:
    """The OpenAI sampling fields -> SamplingParams; any value SamplingParams refuses is a 400."""
    values = {
        "n": _int(body, "n", 1, low=1, high=MAX_N),
        "temperature": _float(body, "temperature", 1.0),
        "top_p": _float(body, "top_p", 1.0),
        "top_k": _int(body, "top_k", -1, high=MAX_VOCAB),        # beyond int64 it killed the engine loop
        "seed": _seed(body),
        "max_tokens": _int(body, "max_tokens", DEFAULT_MAX_TOKENS, low=1, high=MAX_TOKENS),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "presence_penalty": _float(body, "presence_penalty", 0.0),
        "frequency_penalty": _float(body, "frequency_penalty", 0.0),
        "repetition_penalty": _float(body, "repetition_penalty", 1.0),
        "logprobs": _logprobs(body, chat),
    }
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        values["stop_token_ids"] = stop_ids
    try:
        return SamplingParams(**values)
    except RequestError as e:
        param = next((k for k in (*values, "stop_token_ids") if str(e).startswith(k)), None)
        raise ApiError(400, str(e), param) from None


def completion_prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or isinstance(p[0], list)):
        p = p[0]                                  # a batch of one, as the openai client may send
    if isinstance(p, str) and p:
        return bounded_prompt("prompt", p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise bad("prompt", "must be a non-empty string or a non-empty list of token ids (one prompt per request)")


def bounded_prompt(param: str, text: str) -> str:
    if len(text) > MAX_PROMPT_CHARS:
        raise bad(param, f"the prompt may have at most {MAX_PROMPT_CHARS:,} characters, got {len(text):,}")
    return text


def chat_messages(body: dict) -> list[dict[str, str]]:
    """Each message as {role, content} with string content: a list of text parts is joined with newlines
    (as vLLM joins them); any other part type is a 400 naming it."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    messages = [_message(i, m) for i, m in enumerate(msgs)]
    bounded_prompt("messages", "".join(m["content"] for m in messages))
    return messages


def _message(i: int, m: Any) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
            or not isinstance(m.get("content"), (str, list)):
        raise bad("messages", f"each message needs a string role and content (a string or a list of text "
                              f"parts), got {shown(m)}")
    content = m["content"]
    if isinstance(content, list):
        content = "\n".join(_text_part(i, j, part) for j, part in enumerate(content))
    return {"role": m["role"], "content": content}


def _text_part(i: int, j: int, part: Any) -> str:
    where = f"messages[{i}].content[{j}]"
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text":
        raise bad("messages", f"{where}: part type {shown(kind)} is not supported (kvlab serves text models: "
                              f"only 'text' parts)")
    if not isinstance(part.get("text"), str):
        raise bad("messages", f"{where}: a text part needs a string 'text', got {shown(part)}")
    return part["text"]


def model_name(body: Any) -> str:
    """The body's model ("" when missing: the served one)."""
    model = body.get("model", "") if isinstance(body, dict) else ""
    if not isinstance(model, str):
        raise bad("model", f"must be a string, got {shown(model)}")
    return model


def parse(body: Any, chat: bool, render_chat) -> Submission:
    """`render_chat(messages) -> str` turns chat messages into the prompt text."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    stream = _bool(body, "stream", False)
    model = model_name(body)
    _refuse_unsupported(body)
    _user(body)
    echo = _bool(body, "echo", False)
    if chat and echo:
        raise bad("echo", "kvlab supports echo on /v1/completions only")
    if echo and body.get("logprobs") is not None:
        raise bad("echo", "echo with logprobs would need the prompt's log-probabilities, which kvlab does not "
                          "compute")
    if chat and body.get("max_completion_tokens") is not None:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    prompt = render_chat(chat_messages(body)) if chat else completion_prompt(body)
    try:
        params = sampling_params(body, chat)
    except ApiError as e:
        if e.param == "max_tokens" and chat and body.get("max_completion_tokens") is not None:
            e.param, e.message = "max_completion_tokens", "max_completion_tokens" + e.message[len("max_tokens"):]
        raise
    _best_of(body, params.n)
    usage, continuous = _stream_usage(body, stream)
    return Submission(prompt, params, _stop(body), stream, usage, chat, model, continuous, echo,
                      _kv_transfer_params(body))


def tokenize_request(body: Any, render_chat, tokenizer: Any) -> list[int]:
    """vLLM's /tokenize body: {prompt} or {messages} (rendered with the chat template)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if "messages" in body:
        return list(tokenizer.encode(render_chat(chat_messages(body))))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", f"must be a string (or send messages), got {shown(prompt)}")
    return list(tokenizer.encode(prompt))


def detokenize_request(body: Any, vocab_size: int | None) -> list[int]:
    """vLLM's /detokenize body: {tokens: [int, ...]}, each id inside the model's vocabulary (as a prompt's)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens):
        raise bad("tokens", f"must be a list of non-negative token ids, got {shown(tokens)}")
    outside = next((t for t in tokens if vocab_size is not None and t >= vocab_size), None)
    if outside is not None:
        raise bad("tokens", f"token id {shown(outside)} is outside the model's vocabulary [0, {vocab_size})")
    return tokens
