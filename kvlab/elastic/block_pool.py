"""Paged's block pool (reference counts, the free queue, prefix-cache eviction) with its memory mapped on demand.

Every block is in one of three states for the chunk books (elastic/chunks.py): held by a table, free but cached
(its content may still serve a prefix hit, so its chunk stays mapped), or free and uncached (forgettable). Placement:

- `naive`: paged's own order (the free queue's front), mapping whatever chunk the block falls in;
- `page-aware`: the lowest free uncached block of the most-filled mapped chunk, else the lowest unmapped chunk,
  else paged's order (which then takes the least recently freed cached block).

`max_cached` caps the free cached blocks kept (kvcached's MAX_CACHED_TOKENS, in blocks): past it, victims are
forgotten. Naive: least recently freed first. Page-aware: the same number of victims, taken chunk by chunk, the
chunks nothing uses and that keep the fewest blocks first, so the victims empty whole chunks and their memory goes
back (kvcached issue #359, docs/architecture.md "elastic").
"""
from __future__ import annotations

from collections import OrderedDict

from kvlab.elastic.chunks import ChunkBooks
from kvlab.paged.block_pool import BlockPool
from kvlab.paged.prefix_cache import PrefixCache


class ElasticBlockPool(BlockPool):
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None, books: ChunkBooks,
                 placement: str = "page-aware", max_cached: int | None = None) -> None:
        super().__init__(num_blocks, prefix_cache)
        self.books, self.page_aware, self.max_cached = books, placement == "page-aware", max_cached
        self.cached_free: dict[int, None] = {}            # free cached blocks, least recently freed first
        self.cached_in: dict[int, dict[int, None]] = {}   # chunk -> its free cached blocks, same order
        self.cap_evictions = 0
        self.chunks_given = 0      # chunks unmapped by give_back (another engine on the pool asked)

    def allocate(self) -> int:
        block = self._pick()
        if block is None:
            return super().allocate()   # empty: paged's error
        self._map_for(block)                        # may fail: nothing has changed yet
        self._free.move_to_end(block, last=False)   # paged's allocate takes the front
        cached = block in self.cached_free
        super().allocate()
        if cached:
            self._forget_cached(block)
        else:
            self.books.take(block)
        return block

    def _pick(self) -> int | None:
        if not self._free:
            return None
        if self.page_aware:
            block = self.books.fullest_loose_block()
            if block is None:
                block = self.books.lowest_unmapped()
            if block is not None:
                return block
        return next(iter(self._free))

    def _map_for(self, block: int) -> None:
        """Map the block's chunk, and chunk 0 (the tables' padding) since a block is about to be in use."""
        uncached = self._free_uncached
        self.books.ensure_mapped(0, uncached)
        self.books.ensure_mapped(self.books.geo.chunk_of(block), uncached)

    def _free_uncached(self, block: int) -> bool:
        return block in self._free and block not in self.cached_free

    def share(self, block: int) -> None:
        if self.ref_counts[block] == 0 and block not in self.cached_free:   # not reached by paged: cover it
            self._map_for(block)
            self.books.take(block)
        elif self.ref_counts[block] == 0:
            self._map_for(block)
            self._forget_cached(block)
        super().share(block)

    def release(self, block: int) -> None:
        super().release(block)
        if self.ref_counts[block]:
            return
        if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
            self.cached_free[block] = None
            self.cached_in.setdefault(self.books.geo.chunk_of(block), {})[block] = None
            self._apply_cap()
        else:
            self.books.drop(block, self.num_used() > 0)
        if self.num_used() == 0:
            self.books.release_if_empty(0, pinned=False)

    def _forget_cached(self, block: int) -> None:
        del self.cached_free[block]
        chunk = self.books.geo.chunk_of(block)
        del self.cached_in[chunk][block]
        if not self.cached_in[chunk]:
            del self.cached_in[chunk]

    def _apply_cap(self) -> None:
        while self.max_cached is not None and len(self.cached_free) > self.max_cached:
            self._evict(self._victim())
            self.cap_evictions += 1

    def _evict(self, victim: int) -> None:
        self._forget_cached(victim)
        self.prefix_cache.evict(victim)
        self._free.move_to_end(victim, last=False)   # uncached now: reused first, as paged does
        self.books.drop(victim, self.num_used() > 0)

    def cache_only_chunks(self) -> list[int]:
        """Mapped chunks whose every held block is a free cached one (forgetting them unmaps the chunk), fewest
        cached blocks first; chunk 0 not while a block is in use (the tables' padding reads it)."""
        held, pinned = self.books.held, self.num_used() > 0
        chunks = [c for c, blocks in self.cached_in.items() if held[c] == len(blocks) and not (pinned and c == 0)]
        return sorted(chunks, key=lambda c: (held[c], c))

    def givable_pages(self) -> int:
        """Driver pages (every plane) that forgetting cached blocks would unmap."""
        geo = self.books.geo
        return sum(geo.planes * geo.pages_of(c) for c in self.cache_only_chunks())

    def give_back(self, pages: int, most: int | None = None) -> int:
        """Forget the cached blocks of whole chunks, fewest blocks first, until `pages` driver pages are unmapped
        or no chunk holds only cached blocks, unmapping at most `most` pages (the engine's floor); returns the
        pages unmapped."""
        geo, given = self.books.geo, 0
        for chunk in self.cache_only_chunks():
            if given >= pages:
                break
            if most is not None and given + geo.planes * geo.pages_of(chunk) > most:
                continue
            for block in list(self.cached_in[chunk]):
                self._evict(block)
            self.chunks_given += 1
            given += geo.planes * geo.pages_of(chunk)
        return given

    def move_blocks(self, moves: dict[int, int]) -> None:
        """Each new block (free, uncached, in a mapped chunk) takes over its old block's state: its references, or
        its place among the free cached blocks, and its prefix-cache entry (elastic/compaction.py); the old blocks
        become free and uncached, and their chunks unmap once empty. The caller copied the data and rewrote the
        tables first."""
        chunk_of = self.books.geo.chunk_of
        for old, new in moves.items():
            del self._free[new]
            self.books.take(new)
            self.ref_counts[new], self.ref_counts[old] = self.ref_counts[old], 0
            if self.prefix_cache is not None:
                self.prefix_cache.move(old, new)
            if old in self.cached_free:
                del self.cached_in[chunk_of(old)][old]
                if not self.cached_in[chunk_of(old)]:
                    del self.cached_in[chunk_of(old)]
                self.cached_in.setdefault(chunk_of(new), {})[new] = None
        # a moved cached block keeps its place in the eviction order; the old ids go to the front (reused first)
        self.cached_free = dict.fromkeys(moves.get(b, b) for b in self.cached_free)
        self._free = OrderedDict.fromkeys([*moves, *(moves.get(b, b) for b in self._free)])
        pinned = self.num_used() > 0
        for old in moves:
            self.books.drop(old, pinned)

    def _victim(self) -> int:
        if not self.page_aware:
            return next(iter(self.cached_free))
        held = self.books.held
        chunk = min(self.cached_in, key=lambda c: (held[c] > len(self.cached_in[c]), held[c], c))
        return next(iter(self.cached_in[chunk]))

    def check_invariants(self) -> None:
        super().check_invariants()
        geo, books = self.books.geo, self.books
        for chunk in range(geo.num_chunks):
            blocks = geo.blocks_of(chunk)
            held = sum(1 for b in blocks if self.ref_counts[b] or b in self.cached_free)
            assert books.held[chunk] == held, f"chunk {chunk}: books hold {books.held[chunk]} blocks, {held} do"
            must_map = held > 0 or (chunk == 0 and self.num_used() > 0)
            assert (chunk in books.mapped) == must_map, f"chunk {chunk}: mapped {chunk in books.mapped}, held {held}"
            if chunk in books.mapped:
                loose = {b for b in blocks if self._free_uncached(b)}
                assert books.loose[chunk] == loose, f"chunk {chunk}: loose blocks out of date"
        cached = {b for b in self._free if self.prefix_cache is not None and self.prefix_cache.is_cached(b)}
        assert set(self.cached_free) == cached, "free cached blocks out of date"
        assert sum(len(v) for v in self.cached_in.values()) == len(self.cached_free), "per-chunk cache books"
        assert books.num_loose == sum(map(len, books.loose.values())), "loose block count out of date"
