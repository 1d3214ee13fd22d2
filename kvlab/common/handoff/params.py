"""`kv_transfer_params` (vLLM's disaggregated-proxy fields): what a prefill request asks, what the prefill engine
answers and what a decode request brings. Everything a caller can get wrong is a one-line RequestError."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import RequestError
from kvlab.common.handoff.wire import PREFIX
from kvlab.common.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from kvlab.common.handoff.seam import KVHandoff

MAX_ADDRESS = 100
DECODE_KEYS = ("handoff_id", "address", "num_tokens", "first_token_ids", "backend")


def prompt_hash(token_ids: list[int]) -> str:
    """What binds a handoff to its prompt: the prefill engine's answer carries it, the decode engine recomputes it
    from its own request's prompt, and the prefill engine checks it again before exporting (docs/security.md)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def check_sampling(params: SamplingParams, role: str) -> None:
    """One sequence from prompt to end: what the handoff moves (kvlab has no prompt logprobs to refuse)."""
    if params.n > 1 or params.use_beam_search:
        raise RequestError(f"a {role} request takes one sequence: n > 1 and beam search are not supported with "
                           "kv_transfer_params")


def prefill_params(params: SamplingParams, kv: Any) -> SamplingParams:
    """A prefill request computes the prompt and samples one token, whatever max_tokens it was given."""
    if not isinstance(kv, dict) or kv.get("do_remote_decode") is not True:
        raise RequestError('a prefill engine takes kv_transfer_params {"do_remote_decode": true} (or none), '
                           f"got {_shown(kv)}")
    check_sampling(params, "prefill")
    return dataclasses.replace(params, max_tokens=1)


def check_decode(kv: Any, prompt_len: int, config: Any, vocab_size: int | None, backend: KVHandoff) -> None:
    """The fields a decode engine needs, each checked against this engine's config and the prompt; the backend's
    own fields (`KVHandoff.params`) by the backend."""
    if not isinstance(kv, dict) or kv.get("do_remote_prefill") is not True:
        raise RequestError('a decode engine takes the prefill engine\'s kv_transfer_params (with '
                           f'"do_remote_prefill": true), got {_shown(kv)}')
    missing = [k for k in DECODE_KEYS if k not in kv]
    if missing:
        raise RequestError(f"kv_transfer_params lacks {', '.join(missing)}: pass the prefill engine's object whole")
    _check_text(kv, "handoff_id", 64)
    _check_text(kv, "address", MAX_ADDRESS)
    if not kv["address"].startswith(PREFIX):
        raise RequestError(f"kv_transfer_params address {kv['address']!r} is not a kvlab handoff address")
    if type(kv["num_tokens"]) is not int or kv["num_tokens"] != prompt_len:
        raise RequestError(f"kv_transfer_params num_tokens {kv['num_tokens']!r} does not match the prompt's "
                           f"{prompt_len} tokens: send the same prompt to both engines")
    _check_first_token(kv["first_token_ids"], vocab_size)
    if "prompt_hash" in kv:
        _check_text(kv, "prompt_hash", 64)
    if kv["backend"] != config.backend:
        raise RequestError(f"the KV comes from a {_shown(kv['backend'])} engine but this decode engine runs "
                           f"{config.backend!r}: run both roles on the same backend")
    backend.check_params(kv)
    if kv.get("model", config.model) != config.model:
        raise RequestError(f"the KV was computed by model {_shown(kv['model'])}, this decode engine runs "
                           f"{config.model!r}: run both roles on the same model")


def first_logprob(kv: dict, params: SamplingParams, vocab_size: int | None) -> tuple[float, tuple]:
    """The first token's logprob and top candidates, as the prefill engine computed them (it sampled the token),
    cut to this request's logprobs count; (0.0, ()) when the prefill answer holds none and none is asked."""
    entry = kv.get("first_token_logprob")
    if entry is None:
        if params.logprobs is not None:
            raise RequestError("this request asks logprobs but its kv_transfer_params hold no first_token_logprob: "
                               "send the prefill engine's object whole, from a request with the same logprobs")
        return 0.0, ()
    if not isinstance(entry, list) or len(entry) != 2 or not _is_logprob(entry[0]) \
            or not isinstance(entry[1], list) or len(entry[1]) > MAX_LOGPROBS \
            or not all(_is_candidate(c, vocab_size) for c in entry[1]):
        raise RequestError("kv_transfer_params first_token_logprob must be [logprob, [[token id, logprob], ...]] "
                           f"(at most {MAX_LOGPROBS} candidates), got {_shown(entry)}")
    wanted = params.logprobs or 0
    if len(entry[1]) < wanted:
        raise RequestError(f"this request asks logprobs={wanted} but the prefill engine computed {len(entry[1])} "
                           "for the first token: ask both engines for the same logprobs")
    return float(entry[0]), tuple((tid, float(lp)) for tid, lp in entry[1][:wanted])


def _is_logprob(value: Any) -> bool:
    return type(value) in (int, float) and (value == -math.inf or -math.inf < value <= 0)


def _is_candidate(pair: Any, vocab_size: int | None) -> bool:
    return isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and _is_logprob(pair[1]) \
        and 0 <= pair[0] < (vocab_size if vocab_size is not None else 1 << 31)


def _check_text(kv: dict, key: str, limit: int) -> None:
    value = kv[key]
    if not isinstance(value, str) or not 0 < len(value) <= limit or not value.isprintable():
        raise RequestError(f"kv_transfer_params {key} must be printable text of 1 to {limit} characters, "
                           f"got {_shown(value)}")


def _check_first_token(tokens: Any, vocab_size: int | None) -> None:
    if not isinstance(tokens, list) or len(tokens) != 1 or type(tokens[0]) is not int:
        raise RequestError(f"kv_transfer_params first_token_ids must be a list of one token id, got {_shown(tokens)}")
    if tokens[0] < 0 or (vocab_size is not None and tokens[0] >= vocab_size):
        raise RequestError(f"kv_transfer_params first token {tokens[0]} is outside the vocabulary")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
