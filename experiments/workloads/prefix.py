"""Workloads whose prompts share prefixes, as real token ids, for the serving bench (experiments/loadgen/datasets.py
`mooncake:` and `prefix:` datasets), the simulator (`as_sim_requests`) and `kvlab prefix`.

- `load_mooncake`: a Mooncake-schema trace (JSONL: timestamp in ms, input_length, output_length, hash_ids),
  with its stated block size. Each hash id becomes a block of tokens drawn from (seed, id) alone, so equal ids
  give equal token blocks and equal id prefixes give equal token prefixes.
- `system_prompts`: k system prompts with Zipf popularity, each followed by a user tail of its own;
- `multi_turn`: conversations whose every turn's prompt is the whole conversation so far;
- `few_shot`: one shared preamble (the examples) with a varied tail (the question).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlab.common.errors import ConfigError
from kvlab.experiments.workloads.requests import Request

LOW_TOKEN = 3                      # ids below are pad/bos/eos in kvlab's tokenizers
MOONCAKE_BLOCK = 512               # the block size Mooncake's published traces hash with
# hash_ids over 16-token blocks
SAMPLE_TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_sample_bs16.jsonl"


@dataclass(slots=True)
class PrefixRequest:
    token_ids: list[int]
    output_len: int
    arrival_s: float = 0.0
    group: str = ""                # what it shares (system prompt k, conversation c, ...): for reports only


def block_tokens(hash_id: int, block_size: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The tokens of block `hash_id`: a function of (seed, hash_id) only."""
    _check_vocab(vocab_size)
    rng = np.random.default_rng([seed, int(hash_id)])
    return rng.integers(LOW_TOKEN, vocab_size, block_size).tolist()


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= LOW_TOKEN:
        raise ConfigError(f"vocab_size {vocab_size} leaves no ordinary token ids above {LOW_TOKEN}")


def synthesize(hash_ids: list[int], input_length: int, block_size: int, vocab_size: int, seed: int = 0,
               salt: int = 0) -> list[int]:
    """input_length tokens: the hash ids' blocks in order (the last one cut), then, if the ids cover less, tokens
    of this request alone (`salt`)."""
    tokens: list[int] = []
    for h in hash_ids:
        if len(tokens) >= input_length:
            break
        tokens += block_tokens(h, block_size, vocab_size, seed)
    if len(tokens) < input_length:
        rng = np.random.default_rng([seed, 1 << 40, salt])
        tokens += rng.integers(LOW_TOKEN, vocab_size, input_length - len(tokens)).tolist()
    return tokens[:input_length]


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK, vocab_size: int = 32000, seed: int = 0,
                  limit: int | None = None) -> list[PrefixRequest]:
    """A Mooncake-schema JSONL trace; arrivals are seconds from its first timestamp."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            rows.append(_mooncake_row(json.loads(line), f"{path}:{lineno}"))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ConfigError(f"trace file {path} holds no requests")
    t0 = rows[0][0]
    return [PrefixRequest(synthesize(ids, n_in, block_size, vocab_size, seed, salt=i), n_out, (t - t0) / 1000,
                          group=str(ids[0]) if ids else "")
            for i, (t, n_in, n_out, ids) in enumerate(rows)]


def _mooncake_row(row: dict, where: str) -> tuple[float, int, int, list[int]]:
    try:
        out = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), \
            [int(h) for h in row.get("hash_ids", [])]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: need {{timestamp, input_length, output_length, hash_ids}}: {e}") from None
    if out[1] < 1 or out[2] < 1:
        raise ConfigError(f"{where}: input_length and output_length must be >= 1")
    return out


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(LOW_TOKEN, vocab_size, n).tolist()


def system_prompts(n: int, k: int = 4, system_len: int = 256, tail_len: int = 32, output_len: int = 16,
                   zipf_a: float = 1.2, vocab_size: int = 32000, seed: int = 0,
                   interval_s: float = 0.0) -> list[PrefixRequest]:
    """n requests, request i at i * interval_s, with system prompt k_i: P(k) proportional to 1/(k+1)^zipf_a."""
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    prompts = [_tokens(rng, system_len, vocab_size) for _ in range(k)]
    weights = 1.0 / np.arange(1, k + 1) ** zipf_a
    picks = rng.choice(k, size=n, p=weights / weights.sum())
    return [PrefixRequest(prompts[p] + _tokens(rng, tail_len, vocab_size), output_len, i * interval_s,
                          group=f"system{p}") for i, p in enumerate(picks.tolist())]


def multi_turn(conversations: int, turns: int = 4, system_len: int = 64, user_len: int = 32, answer_len: int = 32,
               think_s: float = 1.0, vocab_size: int = 32000, seed: int = 0) -> list[PrefixRequest]:
    """Turn t of a conversation asks with the whole conversation so far (system, then user/answer pairs) and
    arrives think_s after turn t-1; answers are synthetic tokens (what the model said is not known here)."""
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    out = []
    for c in range(conversations):
        history = _tokens(rng, system_len, vocab_size)
        for t in range(turns):
            history = history + _tokens(rng, user_len, vocab_size)
            out.append(PrefixRequest(list(history), answer_len, arrival_s=t * think_s, group=f"conv{c}"))
            history = history + _tokens(rng, answer_len, vocab_size)
    return sorted(out, key=lambda r: r.arrival_s)


def few_shot(n: int, preamble_len: int = 384, tail_len: int = 48, output_len: int = 16, vocab_size: int = 32000,
             seed: int = 0, interval_s: float = 0.0) -> list[PrefixRequest]:
    """n requests, request i at i * interval_s: the preamble, then a tail of its own."""
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    preamble = _tokens(rng, preamble_len, vocab_size)
    return [PrefixRequest(preamble + _tokens(rng, tail_len, vocab_size), output_len, i * interval_s,
                          group="fewshot") for i in range(n)]


WORKLOADS = {"system": system_prompts, "multiturn": multi_turn, "fewshot": few_shot}


def as_sim_requests(requests: list[PrefixRequest]) -> list[Request]:
    """For the simulator (experiments/sim/core.py sends `token_ids` when a request carries them)."""
    return [Request(len(r.token_ids), r.output_len, r.arrival_s, token_ids=r.token_ids) for r in requests]


def shareable_per_request(requests: list[PrefixRequest]) -> list[int]:
    """Per request in arrival order, the prompt tokens an unbounded token-granular cache could skip: its longest
    common prefix with any earlier prompt, at most its length - 1 (the last token is always computed). A cache of
    u-token units can skip at most floor(s / u) * u of them: the rest is the granularity loss."""
    trie: dict = {}
    out = []
    for r in sorted(requests, key=lambda r: r.arrival_s):
        node, depth = trie, 0
        for tok in r.token_ids:
            if tok not in node:
                break
            node, depth = node[tok], depth + 1
        out.append(min(depth, len(r.token_ids) - 1))
        node = trie
        for tok in r.token_ids:
            node = node.setdefault(tok, {})
    return out


def shareable_tokens(requests: list[PrefixRequest]) -> int:
    return sum(shareable_per_request(requests))


def granularity_loss(shareable: list[int], tokens_per_unit: int) -> int:
    """Shareable tokens that are not a whole unit: no u-token cache can skip them."""
    return sum(s % tokens_per_unit for s in shareable)
