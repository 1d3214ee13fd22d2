"""The idle footprint of an elastic engine with a warm prefix cache (kvcached issue #359, docs/architecture.md
"elastic"): an engine serves a burst of requests with prefix caching on and a cap on the free cached blocks it keeps,
then goes idle. What it still maps is set by where the kept blocks sit: naive placement and least-recently-freed
eviction leave them spread over many chunks, page-aware placement and page-wise eviction pack them. Both runs see
the same requests and keep the same number of cached blocks; the floor is those blocks' own bytes.

    python -m kvlab.experiments.studies.idle_footprint [--requests 48] [--cap 64] [--model tiny]
"""
from __future__ import annotations

import argparse
import random
from typing import Any

PLACEMENTS = ("naive", "page-aware")


def burst(num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, output length): distinct prompts of 60-300 tokens, outputs of 8-64, so blocks of many requests
    interleave in the pool."""
    rng = random.Random(seed)
    return [([rng.randint(3, 250) for _ in range(rng.randint(60, 300))], rng.randint(8, 64))
            for _ in range(num_requests)]


def idle_footprint(placement: str, cap: int, num_requests: int = 48, seed: int = 0, model: str = "tiny",
                   kv_cache_bytes: int = 16 * 2**20, page_size: int = 64 * 1024) -> dict[str, Any]:
    """Serve the burst, then report the idle engine's cached blocks, their bytes and what stays mapped."""
    from kvlab import LLM, SamplingParams
    llm = LLM(model=model, backend="elastic", enable_prefix_caching=True, elastic_placement=placement,
              elastic_cached_blocks=cap, elastic_page_size=page_size, kv_cache_bytes=kv_cache_bytes,
              max_model_len=512, max_num_seqs=16)
    engine = llm.engine
    peak = 0
    try:
        for prompt, out in burst(num_requests, seed):
            engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.cache.stats().mapped_bytes)
        stats, books = engine.cache.stats(), engine.cache.allocator
        cached = stats.extra["cached_free_blocks"]
        return {"placement": placement, "cached_blocks": cached, "floor_bytes": cached * books.block_bytes,
                "packed_bytes": -(-cached // books.geo.blocks_per_chunk) * books.geo.mapped_chunk_bytes,
                "idle_mapped_bytes": stats.mapped_bytes, "peak_mapped_bytes": peak,
                "evictions": stats.extra["cap_evictions"], "chunk_bytes": books.geo.mapped_chunk_bytes}
    finally:
        engine.close()


def table(rows: list[dict[str, Any]]) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    lines = [f"{'placement':>11}  {'cached blocks':>13}  {'floor':>10}  {'packed':>10}  {'idle mapped':>11}  "
             f"{'x floor':>7}  {'peak mapped':>11}"]
    for r in rows:
        lines.append(f"{r['placement']:>11}  {r['cached_blocks']:>13}  {mib(r['floor_bytes']):>10}  "
                     f"{mib(r['packed_bytes']):>10}  {mib(r['idle_mapped_bytes']):>11}  "
                     f"{r['idle_mapped_bytes'] / max(r['floor_bytes'], 1):>7.2f}  {mib(r['peak_mapped_bytes']):>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--cap", type=int, default=64, help="free cached blocks kept (elastic_cached_blocks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny")
    args = p.parse_args(argv)
    rows = [idle_footprint(pl, args.cap, args.requests, args.seed, args.model) for pl in PLACEMENTS]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
