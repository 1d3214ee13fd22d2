"""How far an elastic cache's mapped chunks run past what its held blocks need when requests finish in random
order (docs/architecture.md "elastic", compaction). Accounting driver, no model: 16-token blocks, 16 a chunk; 200
requests, 24 at a time, each growing a token a step; at step 100 half of the live ones are freed at once.

    PYTHONPATH=.:tests python tests/helpers/elastic_fragmentation.py [SEEDS]
"""
from __future__ import annotations

import random
import statistics
import sys

from helpers.invariants import SHAPE
from kvlab.common.config import make_config
from kvlab.common.kv.seam import create_cache
from kvlab.common.sequence import Sequence

BLOCK, BLOCKS = 16, 512


def spare_chunks(allocator) -> int:
    pool = allocator.pool
    held = pool.num_used() + len(pool.cached_free)
    return len(pool.books.mapped) - -(-held // pool.books.geo.blocks_per_chunk)


def run(placement: str, compact: int, seed: int, requests: int = 200, at_once: int = 24, burst_at: int = 100) -> dict:
    config = make_config(backend="elastic", elastic_block_size=BLOCK, elastic_page_size=65536, max_model_len=1024,
                         kv_cache_bytes=BLOCKS * BLOCK * SHAPE.bytes_per_token, elastic_placement=placement,
                         elastic_compact=compact, max_num_seqs=64)
    kv = create_cache(config, SHAPE, accounting_only=True)
    cache, rng = kv.allocator, random.Random(seed)
    live: dict[int, Sequence] = {}
    started = step = blocks = 0
    at_frees, burst = [], None
    while started < requests or live:
        while started < requests and len(live) < at_once:
            prompt = [rng.randint(3, 999) for _ in range(rng.randint(16, 256))]
            seq = Sequence(started, str(started), prompt, rng.randint(16, 256))
            if cache.allocate(seq, seq.num_tokens) is None:
                break
            seq.num_computed_tokens = seq.num_tokens
            live[started], started = seq, started + 1
            blocks += -(-(len(prompt) + seq.max_tokens) // BLOCK)
        for sid, seq in list(live.items()):
            if seq.num_tokens - seq.prompt_len >= seq.max_tokens or rng.random() < 0.01:
                cache.free(live.pop(sid))
                at_frees.append(spare_chunks(cache))
                continue
            seq.append_token(rng.randint(3, 999))
            if cache.allocate(seq, seq.num_tokens) is None:
                cache.free(live.pop(sid))
                continue
            seq.num_computed_tokens = seq.num_tokens
        step += 1
        if step == burst_at:
            for sid in rng.sample(sorted(live), len(live) // 2):
                cache.free(live.pop(sid))
            burst = (spare_chunks(cache), len(cache.pool.books.mapped), cache.pool.num_used())
    extra = cache.stats().extra
    kv.close()
    return {"mean_spare": statistics.mean(at_frees), "max_spare": max(at_frees), "burst": burst,
            "moves": extra["compaction_moves"], "chunk_maps": extra["chunk_maps"], "blocks": blocks}


def main(seeds: int = 5) -> None:
    for placement, compact in (("naive", -1), ("page-aware", -1), ("page-aware", 0), ("page-aware", 1),
                               ("page-aware", 2)):
        rs = [run(placement, compact, seed) for seed in range(seeds)]
        mean = statistics.mean(r["mean_spare"] for r in rs)
        print(f"{placement:>10} compact {compact:>2}: spare chunks at a free mean {mean:.2f} "
              f"max {max(r['max_spare'] for r in rs)}; after the burst (spare, mapped, held blocks) "
              f"{[r['burst'] for r in rs]}; moves {[r['moves'] for r in rs]} of ~{rs[0]['blocks']} blocks; "
              f"chunk maps {[r['chunk_maps'] for r in rs]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
