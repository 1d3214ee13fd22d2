"""The chunk books: which chunks are mapped, how many blocks each must keep (held: referenced by a table, or
free but known to the prefix cache), and the free blocks each offers. A chunk is mapped exactly while it holds a
block, and chunk 0 also while any block is in use: paged/storage.py pads block tables with block 0 and kernels read
the padding, so block 0 must be readable whenever a kernel runs.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from kvlab.elastic.geometry import ChunkGeometry


class ChunkBooks:
    def __init__(self, geo: ChunkGeometry, map_chunk: Callable[[int], None],
                 unmap_chunk: Callable[[int], None]) -> None:
        self.geo = geo
        self._map, self._unmap = map_chunk, unmap_chunk
        self.held = [0] * geo.num_chunks
        self.mapped: set[int] = set()
        self.loose: dict[int, set[int]] = {}     # mapped chunk -> its free blocks the prefix cache does not know
        self.chunk_maps = self.chunk_unmaps = 0
        self.num_loose = 0                       # free uncached blocks in mapped chunks, every chunk together
        # placement's two questions in O(log n): heaps checked lazily (an entry is stale once its chunk changed)
        self._fullest: list[tuple[int, int]] = []             # (-held, chunk) of mapped chunks with loose blocks
        self._unmapped = list(range(geo.num_chunks))          # chunk ids, maybe mapped since

    def ensure_mapped(self, chunk: int, free_uncached: Callable[[int], bool]) -> None:
        """Map `chunk` if it is not (its free, uncached blocks become loose). The OS call comes first: if it
        fails, nothing here changed."""
        if chunk in self.mapped:
            return
        self._map(chunk)
        self.mapped.add(chunk)
        self.chunk_maps += 1
        self.loose[chunk] = {b for b in self.geo.blocks_of(chunk) if free_uncached(b)}
        self.num_loose += len(self.loose[chunk])
        self._note(chunk)

    def take(self, block: int) -> None:
        """A free uncached block in a mapped chunk becomes held."""
        chunk = self.geo.chunk_of(block)
        self.held[chunk] += 1
        loose = self.loose[chunk]
        if block in loose:
            loose.discard(block)
            self.num_loose -= 1
        self._note(chunk)

    def drop(self, block: int, pinned: bool) -> None:
        """A held block becomes free and uncached; its chunk is unmapped when it holds nothing (and is not the
        pinned chunk 0)."""
        chunk = self.geo.chunk_of(block)
        self.held[chunk] -= 1
        if block not in self.loose[chunk]:
            self.loose[chunk].add(block)
            self.num_loose += 1
        self._note(chunk)
        self.release_if_empty(chunk, pinned)

    def release_if_empty(self, chunk: int, pinned: bool) -> None:
        if chunk in self.mapped and self.held[chunk] == 0 and not (pinned and chunk == 0):
            self._unmap(chunk)
            self.mapped.discard(chunk)
            self.num_loose -= len(self.loose.pop(chunk))
            self.chunk_unmaps += 1
            heapq.heappush(self._unmapped, chunk)

    def _note(self, chunk: int) -> None:
        """Record chunk's current fill for `fullest_loose_block` (older entries of it go stale)."""
        if len(self._fullest) > 4 * self.geo.num_chunks + 64:   # stale entries pile up below the top: rebuild
            self._fullest = [(-self.held[c], c) for c, blocks in self.loose.items() if blocks]
            heapq.heapify(self._fullest)
        if self.loose.get(chunk):
            heapq.heappush(self._fullest, (-self.held[chunk], chunk))

    def fullest_loose_block(self) -> int | None:
        """The lowest free block of the most-filled mapped chunk that has one (ties: the lowest chunk)."""
        heap = self._fullest
        while heap:
            held, chunk = heap[0]
            if self.loose.get(chunk) and -held == self.held[chunk]:
                return min(self.loose[chunk])
            heapq.heappop(heap)
        return None

    def lowest_unmapped(self) -> int | None:
        """The first block of the lowest chunk not mapped (so the pool stays low)."""
        heap = self._unmapped
        while heap and heap[0] in self.mapped:
            heapq.heappop(heap)
        return heap[0] * self.geo.blocks_per_chunk if heap else None

    def pages_to_map(self, blocks: int, page_aware: bool) -> int:
        """At most how many driver pages (every plane) taking `blocks` free blocks maps: page-aware placement takes
        the loose blocks first, then the lowest unmapped chunks; naive may touch a new chunk with every block.
        Chunk 0 counts whenever it is unmapped (a block in use maps it, elastic/block_pool.py)."""
        if blocks <= 0:
            return 0
        unmapped = self.geo.num_chunks - len(self.mapped)
        fresh = -(-max(0, blocks - self.num_loose) // self.geo.blocks_per_chunk) if page_aware else blocks
        chunks = min(unmapped, max(fresh, 1 if 0 not in self.mapped else 0))
        return chunks * self.geo.planes * self.geo.pages_per_chunk

    def mapped_bytes(self) -> int:
        return sum(self.geo.mapped_bytes(c) for c in self.mapped)
