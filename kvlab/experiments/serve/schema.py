"""The JSON schemas of the completions and chat bodies, as protocol.py reads them, put into the app's OpenAPI
document (/openapi.json): the handlers parse the raw body themselves (one 400 per field, OpenAI-shaped), so
FastAPI cannot infer these. tests/test_serve_fuzz.py draws its requests from this document."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from kvlab.common.limits import MAX_SEED
from kvlab.common.sampling_params import MAX_LOGPROBS
from kvlab.experiments.limits import MAX_N, MAX_STOP_CHARS, MAX_TOKENS, MAX_VOCAB
from kvlab.experiments.serve.protocol import MAX_STOP_STRINGS

NUMBER = {"type": "number"}
BOOL = {"type": "boolean"}
STOP = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                  {"type": "array", "maxItems": MAX_STOP_STRINGS,
                   "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                  {"type": "null"}]}
TRANSFER = {"type": "object",
            "properties": {"do_remote_decode": BOOL, "do_remote_prefill": BOOL, "handoff_id": {"type": "string"},
                           "address": {"type": "string"}, "backend": {"type": "string"},
                           "pool": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                           "num_tokens": {"type": "integer", "minimum": 0},
                           "first_token_ids": {"type": "array", "maxItems": 1,
                                               "items": {"type": "integer", "minimum": 0, "maximum": MAX_VOCAB - 1}},
                           "first_token_logprob": {"type": "array", "maxItems": 2,
                                                   "items": {"anyOf": [{"type": "number", "maximum": 0},
                                                                       {"type": "array", "maxItems": 20,
                                                                        "items": {"type": "array", "maxItems": 2,
                                                                                  "items": {"type": "number"}}}]}}}}
SAMPLING = {
    "model": {"type": "string"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_VOCAB},
    "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
    "stop": STOP,
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": BOOL,
    "stream": BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": BOOL, "continuous_usage_stats": BOOL}},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "user": {"type": "string"},
    "kv_transfer_params": TRANSFER,     # disaggregated serving (docs/disaggregation.md)
}
TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
PROMPT = {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS]}
COMPLETION = {"type": "object", "required": ["prompt"],
              "properties": SAMPLING | {"prompt": PROMPT, "echo": BOOL,
                                        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}}}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
MESSAGE = {"type": "object", "required": ["role", "content"],
           "properties": {"role": {"enum": ["system", "user", "assistant"]},
                          "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}}}
MESSAGES = {"type": "array", "minItems": 1, "items": MESSAGE}
CHAT = {"type": "object", "required": ["messages"],
        "properties": SAMPLING | {"messages": MESSAGES, "max_completion_tokens": SAMPLING["max_tokens"],
                                  "logprobs": BOOL,
                                  "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}}}
TOKENIZE = {"type": "object", "properties": {"model": {"type": "string"}, "prompt": PROMPT, "messages": MESSAGES}}
DETOKENIZE = {"type": "object", "required": ["tokens"],
              "properties": {"model": {"type": "string"}, "tokens": TOKEN_IDS}}
BODIES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/tokenize": TOKENIZE,
          "/detokenize": DETOKENIZE}


def describe_request_bodies(app: FastAPI) -> None:
    """Make app.openapi() include BODIES as the POST bodies of their paths."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            paths = build()["paths"]                  # build() caches its document in app.openapi_schema
            for path, body in BODIES.items():
                paths[path]["post"]["requestBody"] = {"required": True,
                                                      "content": {"application/json": {"schema": body}}}
        return app.openapi_schema
    app.openapi = openapi
