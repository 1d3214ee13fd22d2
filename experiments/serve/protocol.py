"""The OpenAI request schema kvlab serves: a JSON body -> one validated `Submission`, or an `ApiError`.

Only the fields listed in FIELDS are read; an unknown field is ignored (as OpenAI clients send extras), a known
field with a wrong type or value is a 400 naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvlab.common.errors import RequestError
from kvlab.common.limits import MAX_N, MAX_PROMPT_CHARS, MAX_SEED, MAX_STOP_CHARS, MAX_TOKENS, MAX_VOCAB
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.validate import shown

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4


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
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or math.isinf(v):
        raise bad(name, f"must be a finite number, got {v!r}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
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


def _stream_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("stream_options", f"must be an object, got {opts!r}")
    if not stream:
        raise bad("stream_options", "is only allowed with stream=true")
    return _bool(opts, "include_usage", False)


def sampling_params(body: dict) -> SamplingParams:
    """The OpenAI sampling fields -> SamplingParams; any value SamplingParams refuses is a 400."""
    values = {
        "n": _int(body, "n", 1, low=1, high=MAX_N),
        "temperature": _float(body, "temperature", 1.0),
        "top_p": _float(body, "top_p", 1.0),
        "top_k": _int(body, "top_k", -1, high=MAX_VOCAB),        # beyond int64 it killed the engine loop
        "seed": _int(body, "seed", None, low=0, high=MAX_SEED),  # limits.check_seed: every seed its own tokens
        "max_tokens": _int(body, "max_tokens", DEFAULT_MAX_TOKENS, low=1, high=MAX_TOKENS),
        "ignore_eos": _bool(body, "ignore_eos", False),
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
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise bad("messages", f"each message needs a string role and string content, got {m!r}")
    bounded_prompt("messages", "".join(m["content"] for m in msgs))
    return msgs


def parse(body: Any, chat: bool, render_chat) -> Submission:
    """`render_chat(messages) -> str` turns chat messages into the prompt text."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    stream = _bool(body, "stream", False)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad("model", f"must be a string, got {model!r}")
    if chat:
        body = dict(body, max_tokens=body.get("max_completion_tokens", body.get("max_tokens")))
    prompt = render_chat(chat_messages(body)) if chat else completion_prompt(body)
    return Submission(prompt, sampling_params(body), _stop(body), stream, _stream_usage(body, stream), chat, model)
