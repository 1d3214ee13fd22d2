"""Prefix caching: full blocks are named by a chained hash of (parent hash, adapter id, token ids).

A block's hash depends on every token before it, so equal hashes mean equal prefixes, except for
hash collisions, which are caught by comparing the stored key. The cache holds no references: a cached
block whose last user left sits in the pool's free queue and stays reusable until the pool hands it out.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

BlockKey = tuple[int | None, str, tuple[int, ...]]   # (parent hash, adapter id, token ids of the block)
HashFn = Callable[[BlockKey], int]


def default_hash(key: BlockKey) -> int:
    return hash(key)


def chain_keys(token_ids: list[int], adapter_id: str, block_size: int, num_blocks: int,
               first_block: int = 0, parent: int | None = None,
               hash_fn: HashFn = default_hash) -> Iterator[tuple[int, BlockKey]]:
    """Yield (hash, key) of full blocks first_block..num_blocks-1; `parent` is the hash of the block before."""
    for i in range(first_block, num_blocks):
        key = (parent, adapter_id, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        parent = hash_fn(key)
        yield parent, key


class PrefixCache:
    """hash -> block id for blocks whose content is fully computed, plus what each was computed from."""

    def __init__(self, hash_fn: HashFn = default_hash) -> None:
        self.hash_fn = hash_fn
        self._block_of: dict[int, int] = {}
        self._entry_of: dict[int, tuple[int, BlockKey]] = {}   # block id -> (hash, key)
        self.collisions = 0

    def __len__(self) -> int:
        return len(self._entry_of)

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        if self._entry_of[block][1] != key:
            self.collisions += 1
            return None
        return block

    def insert(self, block: int, block_hash: int, key: BlockKey) -> None:
        """Register a full block. The first block registered under a hash keeps it: a duplicate (the same
        prefix computed twice concurrently) or a colliding block stays uncached."""
        if block in self._entry_of or block_hash in self._block_of:
            return
        self._block_of[block_hash] = block
        self._entry_of[block] = (block_hash, key)

    def evict(self, block: int) -> None:
        """Forget a block about to be overwritten (the pool reuses it)."""
        entry = self._entry_of.pop(block, None)
        if entry is not None:
            del self._block_of[entry[0]]

    def is_cached(self, block: int) -> bool:
        return block in self._entry_of

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._entry_of), "prefix cache maps out of sync"
        for block, (block_hash, _) in self._entry_of.items():
            assert self._block_of.get(block_hash) == block, f"block {block} not under its hash"
