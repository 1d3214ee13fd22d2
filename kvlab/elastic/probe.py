"""What the invariant tests check inside the elastic backend: paged's checks (tables, reference counts, the pool
tensor read through the tables), and that memory follows the blocks: every block a table names lies in a mapped
chunk, a chunk is mapped exactly while it keeps a block (or is chunk 0 while any block is in use), and a drained
cache without prefix caching maps nothing."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvlab.paged.probe import TEST_TOKEN_BYTES, PagedProbe

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence


def chunks_in_use(snap: dict[str, Any]) -> set[int]:
    """Chunks that must be mapped: those holding a referenced or free-but-cached block, and chunk 0 while any
    block is referenced."""
    per = snap["blocks_per_chunk"]
    held = {b // per for b, count in enumerate(snap["ref_counts"]) if count} | {b // per for b in snap["cached_free"]}
    return held | ({0} if any(snap["ref_counts"]) else set())


class ElasticProbe(PagedProbe):
    # 24 blocks of 4 tokens; a 4 KiB page holds 4 blocks of one layer's K (or V): 6 chunks
    test_options: dict[str, Any] = {"elastic_block_size": 4, "elastic_page_size": 4096,
                                    "kv_cache_bytes": 24 * 4 * TEST_TOKEN_BYTES}

    def read(self, cache: KVCache, seq: Sequence, n: int) -> torch.Tensor:
        """Paged's read, except that positions in blocks a sliding window dropped (-1) read as zeros: their block
        may be unmapped (paged reads whatever block -1 indexes; callers compare only what the window keeps)."""
        table = torch.tensor(cache.allocator.snapshot()["tables"][seq.seq_id], dtype=torch.int64)
        size = cache.allocator.block_size
        pos = torch.arange(n)
        blocks = table[pos // size]
        kept = blocks >= 0
        out = torch.zeros(cache.shape.num_layers, 2, n, cache.shape.num_kv_heads, cache.shape.head_dim,
                          dtype=cache.storage.kv.dtype)
        out[:, :, kept] = cache.storage.kv[:, :, blocks[kept], pos[kept] % size].transpose(0, 1)
        return out

    def check_structure(self, cache: KVCache, live: dict[int, Sequence], swapped: set[int],
                        may_share: Callable[[int, int, int], bool]) -> None:
        super().check_structure(cache, live, swapped, may_share)
        snap = cache.allocator.snapshot()
        assert set(snap["mapped_chunks"]) == chunks_in_use(snap), (
            f"mapped chunks {snap['mapped_chunks']} != chunks in use {sorted(chunks_in_use(snap))}")
        books = cache.allocator
        assert books.memory.mapped_pages() * books.geo.page_size == books.stats().mapped_bytes, (
            f"the driver maps {books.memory.mapped_pages()} pages, the stats say {books.stats().mapped_bytes} bytes")

    def check_drained(self, cache: KVCache) -> None:
        super().check_drained(cache)
        snap = cache.allocator.snapshot()
        if not snap["prefix_caching"]:
            assert not snap["mapped_chunks"], f"a drained cache still maps chunks {snap['mapped_chunks']}"

    def check_closed(self, cache: KVCache) -> None:
        super().check_closed(cache)
        assert cache.allocator.memory.closed, "the elastic memory outlived close()"


PROBE = ElasticProbe()
