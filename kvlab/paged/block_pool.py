"""The physical block pool: reference counts and a free queue, every operation O(1).

The free queue is an insertion-ordered dict used as a deque that also supports O(1) removal from the
middle (what vLLM builds as an intrusive doubly linked list). `allocate` takes from the front. A block
whose last reference goes away is put at the front if it holds nothing reusable (reused first), or at
the back if the prefix cache knows its content (so cached blocks are evicted least-recently-freed
first, and a prefix hit can take one back out of the queue).
"""
from __future__ import annotations

from collections import OrderedDict

from kvlab.common.errors import KvlabError, OutOfKVCache
from kvlab.paged.prefix_cache import PrefixCache


class BlockPoolError(KvlabError, RuntimeError):
    """Block bookkeeping was misused (double free, unknown block): a bug in the caller."""


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache = prefix_cache
        self.num_shared = 0   # blocks with reference count > 1, kept current so stats() is O(1)

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def allocate(self) -> int:
        """A block with reference count 1; its old content (cached or not) is forgotten."""
        if not self._free:
            raise OutOfKVCache(f"all {self.num_blocks} KV blocks are in use; free a sequence or raise "
                               f"kv_cache_bytes")
        block, _ = self._free.popitem(last=False)
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more table references `block` (fork, prefix hit); a freed cached block comes back to life."""
        self._check_id(block)
        if self.ref_counts[block] == 0:
            del self._free[block]
        elif self.ref_counts[block] == 1:
            self.num_shared += 1
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self._check_id(block)
        count = self.ref_counts[block]
        if count <= 0:
            raise BlockPoolError(f"block {block} released with reference count {count} (double free)")
        self.ref_counts[block] = count - 1
        if count == 2:
            self.num_shared -= 1
        if count == 1:
            self._free[block] = None
            if self.prefix_cache is None or not self.prefix_cache.is_cached(block):
                self._free.move_to_end(block, last=False)

    def release_all(self, table: list[int]) -> None:
        """Release a whole block table, tail first: cached tails are evicted before their prefixes."""
        for block in reversed(table):
            self.release(block)

    def free_blocks(self) -> list[int]:
        """The free queue in the order `allocate` takes from it."""
        return list(self._free)

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise BlockPoolError(f"block id {block} is outside the pool [0, {self.num_blocks})")

    def check_invariants(self) -> None:
        free_with_refs = [b for b in self._free if self.ref_counts[b]]
        assert not free_with_refs, f"blocks both free and referenced: {free_with_refs[:8]}"
        used = sum(1 for c in self.ref_counts if c > 0)
        assert used + len(self._free) == self.num_blocks, (
            f"used {used} + free {len(self._free)} != total {self.num_blocks}")
        assert min(self.ref_counts, default=0) >= 0, "negative reference count"
        shared = sum(1 for c in self.ref_counts if c > 1)
        assert shared == self.num_shared, f"shared-block count {self.num_shared} != actual {shared}"
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
