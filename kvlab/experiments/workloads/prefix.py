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

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN, check_seed
from kvlab.common.validate import check_int, check_number, parse_int
from kvlab.experiments.limits import MAX_HASH_ID, MAX_PROMPT_TOKENS, MAX_SPAN_S, MAX_VOCAB
from kvlab.experiments.workloads.jsonl import TraceLine, request_lines
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
    check_int("vocab_size", vocab_size, LOW_TOKEN + 1, MAX_VOCAB, f" (ids below {LOW_TOKEN} are special)")


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


MOONCAKE_SCHEMA = "{timestamp, input_length, output_length[, hash_ids]}"


@dataclass(frozen=True, slots=True)
class MooncakeRow:
    where: str
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK, vocab_size: int = 32000, seed: int = 0,
                  limit: int | None = None) -> list[PrefixRequest]:
    """A Mooncake-schema JSONL trace; arrivals are seconds from its earliest timestamp. Keys beyond the schema
    are ignored (other tools add their own)."""
    block_size = check_int("block size", block_size, 1, MAX_MODEL_LEN, " (tokens per hash id)")
    seed = check_seed("seed", seed)
    _check_vocab(vocab_size)
    rows = read_mooncake(path, limit)
    t0 = min(r.timestamp_ms for r in rows)
    return [PrefixRequest(synthesize(r.hash_ids, r.input_length, block_size, vocab_size, seed, salt=i),
                          r.output_length, (r.timestamp_ms - t0) / 1000,
                          group=str(r.hash_ids[0]) if r.hash_ids else "")
            for i, r in enumerate(rows)]


def parse_mooncake(spec: str) -> tuple[str, int]:
    """`FILE.jsonl[:BLOCK]` (the serving bench's `mooncake:` dataset) as (path, block size)."""
    path, _, block = spec.partition(":")
    if not block:
        return path, MOONCAKE_BLOCK
    return path, parse_int("mooncake block size", block, 1, MAX_MODEL_LEN, " (tokens per hash id)")


def read_mooncake(path: str | Path, limit: int | None = None) -> list[MooncakeRow]:
    """The first `limit` rows (at most MAX_REQUESTS), every field checked, their prompts at most
    MAX_PROMPT_TOKENS in all and their timestamps within MAX_SPAN_S of each other."""
    rows: list[MooncakeRow] = []
    tokens = 0
    for line in request_lines(path, MOONCAKE_SCHEMA, limit):
        rows.append(_mooncake_row(line))
        tokens += rows[-1].input_length
        if tokens > MAX_PROMPT_TOKENS:
            raise ConfigError(f"{line.where}: the trace's prompts reach {tokens:,} tokens, more than the maximum "
                              f"{MAX_PROMPT_TOKENS:,} (MAX_PROMPT_TOKENS); load fewer requests")
    _check_span(rows)
    return rows


def _mooncake_row(line: TraceLine) -> MooncakeRow:
    n_in, n_out = line.lengths("input_length", "output_length", high=MAX_MODEL_LEN)
    check_int(f"{line.where}: input_length + output_length", n_in + n_out, 2, MAX_MODEL_LEN, " (tokens per sequence)")
    return MooncakeRow(line.where, line.number("timestamp", math.inf, unit=" ms"), n_in, n_out,
                       line.integers("hash_ids", MAX_HASH_ID, default=[]))


def _check_span(rows: list[MooncakeRow]) -> None:
    """Arrivals beyond a week (a timestamp of 1e300) would keep a replay waiting forever."""
    t0 = min(r.timestamp_ms for r in rows)
    for r in rows:
        check_number(f"{r.where}: arrival (timestamp minus the earliest, {t0:g} ms)", (r.timestamp_ms - t0) / 1000,
                     0.0, MAX_SPAN_S, unit=" s")


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
