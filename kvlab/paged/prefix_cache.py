"""Prefix caching: full blocks are named by a chained hash of (parent hash, adapter id, token ids).

A block's hash depends on every token before it, so equal hashes mean equal prefixes, except for
hash collisions, which are caught by comparing the stored key. The cache holds no references: a cached
block whose last user left sits in the pool's free queue and stays reusable until the pool hands it out.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvlab.common.kv.prefix_hash import BlockKey, HashFn, chain_keys, default_hash
from kvlab.paged.block_table import SeqBlocks

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence

__all__ = ["BlockKey", "HashFn", "PrefixCache", "PrefixIndex", "chain_keys", "default_hash"]


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

    def move(self, old: int, new: int) -> None:
        """The cached data now lives in block `new` (elastic's compaction copied it there)."""
        entry = self._entry_of.pop(old, None)
        if entry is not None:
            self._entry_of[new] = entry
            self._block_of[entry[0]] = new

    def is_cached(self, block: int) -> bool:
        return block in self._entry_of

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._entry_of), "prefix cache maps out of sync"
        for block, (block_hash, _) in self._entry_of.items():
            assert self._block_of.get(block_hash) == block, f"block {block} not under its hash"


class PrefixIndex:
    """The allocator's use of the prefix cache: find a new sequence's cached leading blocks, and register a
    sequence's computed full blocks. Does nothing when prefix caching is off (`cache` is None)."""

    def __init__(self, cache: PrefixCache | None, block_size: int) -> None:
        self.cache, self.block_size = cache, block_size

    def match(self, seq: Sequence, num_tokens: int, held: Iterable[SeqBlocks]) -> list[tuple[int, int]]:
        """(block, hash) of leading cached full blocks, leaving at least the last token to recompute."""
        if self.cache is None:
            return []
        for entry in held:     # blocks computed since their sequence's last allocate
            self.register(entry.seq, entry)
        limit = (min(num_tokens, seq.num_tokens) - 1) // self.block_size
        hits = []
        for block_hash, key in chain_keys(seq.token_ids, seq.adapter_id, self.block_size, limit,
                                          hash_fn=self.cache.hash_fn):
            block = self.cache.lookup(block_hash, key)
            if block is None:
                break
            hits.append((block, block_hash))
        return hits

    def register(self, seq: Sequence, entry: SeqBlocks) -> None:
        """Make the sequence's full, computed blocks findable by later requests."""
        if self.cache is None:
            return
        full = min(seq.num_computed_tokens, entry.num_tokens, seq.num_tokens) // self.block_size
        start = len(entry.hashes)
        parent = entry.hashes[-1] if entry.hashes else None
        keys = chain_keys(seq.token_ids, seq.adapter_id, self.block_size, full, start, parent, self.cache.hash_fn)
        for j, (block_hash, key) in enumerate(keys, start):
            self.cache.insert(entry.table[j], block_hash, key)
            entry.hashes.append(block_hash)
