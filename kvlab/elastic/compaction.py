"""Compaction: after frees, move held blocks out of the sparsest mapped chunks into free blocks of the others, so
that the mapped chunks are as few as the held blocks need (the slack stays under one chunk: one page per layer and
K/V when a chunk is a page). Placement alone cannot bound it: requests that finish in random order leave a few
live blocks in many chunks (docs/architecture.md "elastic"). Each move is a copy of one block (every layer, K and
V: a `CopyKV` order, as copy-on-write's) and a rewrite of the tables that name it; a block's prefix-cache entry
moves with it, so what a later prompt can hit stays the same.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

from kvlab.common.kv.types import CopyKV
from kvlab.elastic.block_pool import ElasticBlockPool
from kvlab.paged.block_table import SeqBlocks


def chunks_needed(pool: ElasticBlockPool) -> int:
    """The fewest chunks that hold the held blocks (referenced, or free and cached)."""
    held = pool.num_used() + len(pool.cached_free)
    return -(-held // pool.books.geo.blocks_per_chunk)


def compact(pool: ElasticBlockPool, tables: Collection[SeqBlocks], block_size: int, emit: Callable[[CopyKV], None],
            spare: int = 0) -> int:
    """Empty the sparsest chunks (never chunk 0 while a block is in use: it stays mapped as the tables' padding)
    into loose blocks of the others, chunk 0 first, then the fullest, until the mapped chunks are at most `spare`
    more than the held blocks need, or no chunk's blocks fit elsewhere; returns the blocks moved."""
    books, moved = pool.books, 0
    while len(books.mapped) > chunks_needed(pool) + spare:
        pinned = pool.num_used() > 0
        victims = [c for c in books.mapped if not (pinned and c == 0)]
        if not victims:
            break
        victim = min(victims, key=lambda c: (books.held[c], -c))
        blocks = [b for b in books.geo.blocks_of(victim) if pool.ref_counts[b] or b in pool.cached_free]
        targets = [b for c in sorted(books.mapped - {victim}, key=lambda c: (c != 0, -books.held[c], c))
                   for b in sorted(books.loose[c])]
        if len(targets) < len(blocks):
            break
        moves = dict(zip(blocks, targets))
        for old, new in moves.items():
            emit(CopyKV(old, new, block_size))
        for entry in tables:
            entry.table[:] = [moves.get(b, b) for b in entry.table]
        pool.move_blocks(moves)
        moved += len(moves)
    return moved
