"""What the load generator sends: prompt token ids and output lengths, seeded.

- seed: the seed article's length distribution (experiments.workload), scaled by --scale;
- random: uniform lengths, --input-len / --output-len +- --range-ratio;
- trace:FILE.jsonl: one {"timestamp", "input_length", "output_length"[, "hash_ids"]} per line; timestamps (ms,
  as Mooncake traces) replace the drawn arrivals; hash_ids are ignored (lengths only);
- mooncake:FILE.jsonl[:BLOCK]: the same schema with prompt tokens synthesised from hash_ids over BLOCK-token
  blocks (default 512): equal ids give equal blocks, so the server's prefix cache sees the trace's sharing;
- prefix:system | prefix:multiturn | prefix:fewshot: experiments/workloads/prefix.py's generators.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlab.common.errors import ConfigError
from kvlab.experiments.workloads.requests import seed_lengths

LOW_TOKEN = 3                      # ids below are pad/bos/eos in kvlab's tokenizers


@dataclass(slots=True)
class LoadRequest:
    prompt: list[int]
    output_len: int
    timestamp: float | None = None   # seconds from the start (traces only)


def build(spec: str, n: int, seed: int, vocab_size: int, scale: float = 1 / 8, max_len: int = 4096,
          input_len: int = 64, output_len: int = 32, range_ratio: float = 0.0) -> list[LoadRequest]:
    if spec.startswith(("mooncake:", "prefix:")):    # prompts with real shared prefixes, not drawn lengths
        return prefix_dataset(spec, n, seed, vocab_size)
    rng = np.random.default_rng(seed)
    lengths, stamps = draw_lengths(spec, n, rng, scale, max_len, input_len, output_len, range_ratio)
    return [LoadRequest(rng.integers(LOW_TOKEN, vocab_size, pl).tolist(), ol, ts)
            for (pl, ol), ts in zip(lengths, stamps)]


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
        rows = read_trace(spec[len("trace:"):], n)
        lengths = [(r["input_length"], r["output_length"]) for r in rows]
        t0 = rows[0]["timestamp"]
        stamps = [(r["timestamp"] - t0) / 1000 for r in rows]
    else:
        raise ConfigError(f"unknown --dataset {spec!r}: use seed, random, trace:FILE.jsonl, "
                          "mooncake:FILE.jsonl[:BLOCK] or prefix:system|multiturn|fewshot")
    return [(max(1, int(pl)), max(1, int(ol))) for pl, ol in lengths], stamps


def prefix_dataset(spec: str, n: int, seed: int, vocab_size: int) -> list[LoadRequest]:
    from kvlab.experiments.workloads import prefix as pw
    kind, _, rest = spec.partition(":")
    if kind == "mooncake":
        path, _, block = rest.partition(":")
        reqs = pw.load_mooncake(path, int(block) if block else pw.MOONCAKE_BLOCK, vocab_size, seed, limit=n)
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


def read_trace(path: str, limit: int) -> list[dict]:
    if not Path(path).is_file():
        raise ConfigError(f"trace file {path} does not exist")
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append({"timestamp": float(row["timestamp"]), "input_length": int(row["input_length"]),
                         "output_length": int(row["output_length"])})
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}:{lineno}: need {{timestamp, input_length, output_length}}: {e}") from None
        if len(rows) >= limit:
            break
    if not rows:
        raise ConfigError(f"trace file {path} holds no requests")
    return rows
