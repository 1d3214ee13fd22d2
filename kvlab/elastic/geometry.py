"""Where each block lives in the elastic pool's virtual memory, and which physical pages back it.

The pool tensor is paged's, [2, L, num_blocks, block_size, H_kv, D], laid out as 2L planes (one per layer and K or
V), each a contiguous [num_blocks, block_size, H_kv, D] starting on a page boundary. Memory is mapped a *chunk* at a
time: the same block range in every plane, `chunk_bytes` per plane, the least common multiple of the page and one
block's bytes in one plane, so no block straddles a chunk and no page is shared by two chunks. Chunk c holds blocks
[c * blocks_per_chunk, (c + 1) * blocks_per_chunk). The pool has paged's number of blocks (the budget over a block's
bytes), so the last chunk may be partial: only the pages its blocks touch are mapped, and the mapped bytes exceed
the budget by less than one page per plane.

Physical pool pages are numbered chunk-major: chunk c of plane i is backed by pages
[c * planes * pages_per_chunk + i * pages_per_chunk, + pages_per_chunk), so the pool only ever needs to reach the
highest chunk mapped, and the low chunks page-aware placement fills keep it small.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.common.errors import ConfigError
from kvlab.common.kv.types import KVShape


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    planes: int               # 2L: every layer's K and V
    plane_block_bytes: int    # one block in one plane
    page_size: int            # the driver's page (after rounding to its granularity)
    chunk_bytes: int          # per plane: lcm(page_size, plane_block_bytes)
    num_blocks: int           # paged's: the budget over one block's bytes (every plane)
    itemsize: int

    @classmethod
    def of(cls, shape: KVShape, block_size: int, page_size: int, budget_bytes: int) -> ChunkGeometry:
        planes = 2 * shape.num_layers
        plane_block = block_size * shape.bytes_per_token_per_layer
        num_blocks = budget_bytes // (plane_block * planes)
        if num_blocks == 0:
            raise ConfigError(f"kv_cache_bytes {budget_bytes} is smaller than one block ({plane_block * planes} "
                              f"bytes); raise kv_cache_bytes or lower elastic_block_size")
        return cls(planes, plane_block, page_size, math.lcm(page_size, plane_block), num_blocks, shape.itemsize)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_bytes // self.plane_block_bytes

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_bytes // self.page_size

    @property
    def num_chunks(self) -> int:
        return -(-self.num_blocks // self.blocks_per_chunk)

    def pages_of(self, chunk: int) -> int:
        """Pages per plane chunk `chunk` maps: all of them but in a partial last chunk, those its blocks touch."""
        blocks = len(self.blocks_of(chunk))
        return -(-blocks * self.plane_block_bytes // self.page_size)

    @property
    def plane_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.planes * self.plane_bytes

    @property
    def mapped_chunk_bytes(self) -> int:
        """Physical bytes one whole mapped chunk takes, every plane."""
        return self.planes * self.chunk_bytes

    def mapped_bytes(self, chunk: int) -> int:
        """Physical bytes chunk `chunk` takes when mapped, every plane."""
        return self.planes * self.pages_of(chunk) * self.page_size

    def chunk_of(self, block: int) -> int:
        return block // self.blocks_per_chunk

    def blocks_of(self, chunk: int) -> range:
        return range(chunk * self.blocks_per_chunk, min((chunk + 1) * self.blocks_per_chunk, self.num_blocks))

    def first_store_page(self, chunk: int) -> int:
        """The pool page backing chunk `chunk` in plane 0; plane i's is `pages_per_chunk` * i further."""
        return chunk * self.planes * self.pages_per_chunk

    def store_pages_through(self, chunk: int) -> int:
        """How many pool pages chunks 0 .. `chunk` need."""
        return (chunk + 1) * self.planes * self.pages_per_chunk

    def strides(self, block_size: int, shape: KVShape) -> tuple[int, ...]:
        """Element strides of [2, L, num_blocks, block_size, H_kv, D] over the planes laid end to end."""
        plane = self.plane_bytes // self.itemsize
        head = shape.head_dim
        return (shape.num_layers * plane, plane, block_size * shape.num_kv_heads * head, shape.num_kv_heads * head,
                head, 1)
