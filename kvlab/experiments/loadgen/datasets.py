"""What the load generator sends: prompts (text by default, as vLLM sends them; token ids with --token-ids) and
output lengths, seeded.

- random (vLLM's default): uniform lengths, --random-input-len / --random-output-len +- --random-range-ratio,
  after a shared --random-prefix-len-token prefix;
- sharegpt:FILE.json: ShareGPT conversations from a local file (experiments/loadgen/prompts.py);
- seed: the seed article's length distribution (experiments.workload), scaled by --scale;
- trace:FILE.jsonl: one {"timestamp", "input_length", "output_length"[, "hash_ids"]} per line; timestamps (ms,
  as Mooncake traces) replace the drawn arrivals; hash_ids are ignored (lengths only);
- mooncake:FILE.jsonl[:BLOCK]: the same schema with prompt tokens synthesised from hash_ids over BLOCK-token
  blocks (default 512): equal ids give equal blocks, so the server's prefix cache sees the trace's sharing;
- prefix:system | prefix:multiturn | prefix:fewshot: experiments/workloads/prefix.py's generators.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab.common.errors import ConfigError
from kvlab.common.validate import shown
from kvlab.experiments.loadgen import prompts
from kvlab.experiments.workloads.requests import seed_lengths

LOW_TOKEN = 3                      # ids below are pad/bos/eos in kvlab's tokenizers


@dataclass(slots=True)
class LoadRequest:
    prompt: list[int] | str          # token ids, or text (what vLLM sends)
    output_len: int
    timestamp: float | None = None   # seconds from the start (traces only)
    prompt_len: int = 0              # tokens; 0: len(prompt), for token ids

    def __post_init__(self) -> None:
        if not self.prompt_len and isinstance(self.prompt, list):
            self.prompt_len = len(self.prompt)


def build(spec: str, n: int, seed: int, vocab_size: int, scale: float = 1 / 8, max_len: int = 4096,
          input_len: int = 64, output_len: int = 32, range_ratio: float = 0.0, prefix_len: int = 0,
          tokenizer: Any = None) -> list[LoadRequest]:
    """Token-id prompts, or with a tokenizer text prompts (the drawn ids decoded, as vLLM sends them)."""
    if spec.startswith("sharegpt:"):
        if tokenizer is None:
            raise ConfigError("the sharegpt dataset sends text: drop --token-ids")
        return [LoadRequest(text, olen, None, plen) for text, plen, olen in
                prompts.sharegpt(spec[len("sharegpt:"):], n, seed, tokenizer)]
    reqs = id_requests(spec, n, seed, vocab_size, scale, max_len, input_len, output_len, range_ratio, prefix_len)
    return reqs if tokenizer is None else [as_text(r, tokenizer) for r in reqs]


def id_requests(spec: str, n: int, seed: int, vocab_size: int, scale: float, max_len: int, input_len: int,
                output_len: int, range_ratio: float, prefix_len: int) -> list[LoadRequest]:
    if spec.startswith(("mooncake:", "prefix:")):    # prompts with real shared prefixes, not drawn lengths
        return prefix_dataset(spec, n, seed, vocab_size)
    rng = np.random.default_rng(seed)
    lengths, stamps = draw_lengths(spec, n, rng, scale, max_len, input_len, output_len, range_ratio)
    prefix = rng.integers(LOW_TOKEN, vocab_size, prefix_len).tolist()
    return [LoadRequest(prefix + rng.integers(LOW_TOKEN, vocab_size, pl).tolist(), ol, ts)
            for (pl, ol), ts in zip(lengths, stamps)]


def as_text(req: LoadRequest, tokenizer: Any) -> LoadRequest:
    """The prompt's ids mapped into ids whose text re-encodes to as many tokens, then decoded."""
    ids = prompts.id_range(tokenizer)
    text = tokenizer.decode([ids[i % len(ids)] for i in req.prompt])
    return LoadRequest(text, req.output_len, req.timestamp, prompts.count_tokens(tokenizer, text))


def draw_lengths(spec: str, n: int, rng: np.random.Generator, scale: float = 1 / 8, max_len: int = 4096,
                 input_len: int = 64, output_len: int = 32, range_ratio: float = 0.0
                 ) -> tuple[list[tuple[int, int]], list[float | None]]:
    """(prompt length, output length) per request, each >= 1, and trace timestamps (None when drawn); no token
    ids (the simulator needs none). `build` draws its token ids from the same generator afterwards."""
    if spec == "seed":
        p, o = seed_lengths(rng, n, max_len, scale)
        lengths = list(zip(p.tolist(), o.tolist()))
        stamps = [None] * n
    elif spec == "random":
        lengths = [(uniform(rng, input_len, range_ratio), uniform(rng, output_len, range_ratio)) for _ in range(n)]
        stamps = [None] * n
    elif spec.startswith("trace:"):
        from kvlab.experiments.workloads.prefix import read_mooncake
        rows = read_mooncake(spec[len("trace:"):], n)
        t0 = min(r.timestamp_ms for r in rows)
        lengths = [(r.input_length, r.output_length) for r in rows]
        stamps = [(r.timestamp_ms - t0) / 1000 for r in rows]
    else:
        raise ConfigError(f"unknown --dataset-name {shown(spec)}: use random, sharegpt, seed, trace, mooncake[:BLOCK] "
                          "(each with --dataset-path FILE) or prefix:system|multiturn|fewshot")
    return [(max(1, int(pl)), max(1, int(ol))) for pl, ol in lengths], stamps


def prefix_dataset(spec: str, n: int, seed: int, vocab_size: int) -> list[LoadRequest]:
    from kvlab.experiments.workloads import prefix as pw
    kind, _, rest = spec.partition(":")
    if kind == "mooncake":
        path, block = pw.parse_mooncake(rest)
        reqs = pw.load_mooncake(path, block, vocab_size, seed, limit=n)
        return [LoadRequest(list(r.token_ids), r.output_len, r.arrival_s) for r in reqs]
    if rest not in pw.WORKLOADS:
        raise ConfigError(f"unknown --dataset {spec!r}: prefix:system, prefix:multiturn or prefix:fewshot")
    gen = pw.WORKLOADS[rest]
    reqs = gen(n, vocab_size=vocab_size, seed=seed) if rest != "multiturn" else \
        gen(max(1, n // 4), vocab_size=vocab_size, seed=seed)
    return [LoadRequest(list(r.token_ids), r.output_len, None) for r in reqs[:n]]


def uniform(rng: np.random.Generator, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return int(rng.integers(lo, hi + 1))
