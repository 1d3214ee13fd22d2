"""Prefix caching on the vmm backend by page aliasing.

A full, computed page group is named by the chained hash of its tokens (common/kv/prefix_hash.py, the hashing
paged uses; the adapter id is part of every key). A new sequence whose prompt starts with cached pages gets
those page groups mapped again into its own slot at the same page indices (the fork path: refcount raised,
copy-on-write if written), and computes only the rest.

The cache holds no mapping of its own. A cached group that no slot maps any more keeps its physical pages
(unmapped, out of the free pool) and waits in an LRU of idle groups; idle groups count as free capacity, and
the allocator evicts them, oldest first and a whole group at a time, when the pool runs short. On a shared pool
(docs/pool.md) the pool is told which pages hold cached data (`KeptGroups`): unmapped, they are not spares to
reuse or give back; an eviction lets them go.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

from kvlab.common.kv.prefix_hash import BlockKey, HashFn, chain_keys, default_hash

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence


class PageKeeper(Protocol):
    """The machine-wide pool, which must know which pages hold cached data (vmm/drivers/machine_pool.py; with no
    pool it does nothing)."""

    def keep(self, pages: list[int]) -> None: ...
    def let_go(self, pages: list[int]) -> None: ...


class KeptGroups:
    """Cached page groups told to the pool as driver pages: group g is page t * num_groups + g of each tensor t."""

    def __init__(self, pool: PageKeeper, num_groups: int, num_tensors: int) -> None:
        self.pool, self.num_groups, self.num_tensors = pool, num_groups, num_tensors

    def pages(self, groups: list[int]) -> list[int]:
        return [t * self.num_groups + g for g in groups for t in range(self.num_tensors)]

    def keep(self, groups: list[int]) -> None:
        self.pool.keep(self.pages(groups))

    def let_go(self, groups: list[int]) -> None:
        self.pool.let_go(self.pages(groups))


class PagePrefixCache:
    """hash -> page group for computed full pages, what each was computed from, the idle LRU, and each live
    sequence's chain of registered page hashes. `keeper`: told when groups enter and leave the cache."""

    def __init__(self, tokens_per_page: int, hash_fn: HashFn = default_hash, keeper: KeptGroups | None = None) -> None:
        self.tokens_per_page, self.hash_fn, self.keeper = tokens_per_page, hash_fn, keeper
        self._group_of: dict[int, int] = {}                     # hash -> group
        self._entry_of: dict[int, tuple[int, BlockKey]] = {}    # group -> (hash, key)
        self.idle: OrderedDict[int, None] = OrderedDict()       # cached groups no slot maps, least recent first
        self.chains: dict[int, list[int]] = {}                  # seq_id -> hashes of its leading registered pages
        self.collisions = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entry_of)

    def is_cached(self, group: int) -> bool:
        return group in self._entry_of

    # -- admission ----------------------------------------------------------------------------------------
    def match(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """(group, hash) of the sequence's leading cached pages, leaving at least its last token to compute."""
        limit = (min(num_tokens, seq.num_tokens) - 1) // self.tokens_per_page
        hits: list[tuple[int, int]] = []
        for page_hash, key in chain_keys(seq.token_ids, seq.adapter_id, self.tokens_per_page, limit,
                                         hash_fn=self.hash_fn):
            group = self._group_of.get(page_hash)
            if group is None:
                break
            if self._entry_of[group][1] != key:
                self.collisions += 1
                break
            hits.append((group, page_hash))
        return hits

    def idle_hits(self, hits: list[tuple[int, int]]) -> int:
        """How many hits are idle groups (aliasing them takes them out of the free capacity)."""
        return sum(1 for group, _ in hits if group in self.idle)

    # -- registration -------------------------------------------------------------------------------------
    def register(self, seq: Sequence, groups: list[int], tokens: int) -> None:
        """Make the sequence's first `tokens // tokens_per_page` pages (computed, full) findable."""
        chain = self.chains.setdefault(seq.seq_id, [])
        full = min(tokens // self.tokens_per_page, len(groups))
        if full <= len(chain):
            return
        parent = chain[-1] if chain else None
        for j, (page_hash, key) in enumerate(chain_keys(seq.token_ids, seq.adapter_id, self.tokens_per_page, full,
                                                        len(chain), parent, self.hash_fn), len(chain)):
            self._insert(groups[j], page_hash, key)
            chain.append(page_hash)

    def _insert(self, group: int, page_hash: int, key: BlockKey) -> None:
        """The first group registered under a hash keeps it; a duplicate or colliding page stays uncached."""
        if group in self._entry_of or page_hash in self._group_of:
            return
        self._group_of[page_hash] = group
        self._entry_of[group] = (page_hash, key)
        if self.keeper is not None:
            self.keeper.keep([group])

    def adopt(self, seq_id: int, hashes: list[int]) -> None:
        """A sequence starts with these registered pages (its prefix hits, or a fork parent's chain)."""
        self.chains[seq_id] = list(hashes)

    def forget(self, seq_id: int) -> None:
        """The sequence no longer maps its pages (freed, swapped out): its chain starts over."""
        self.chains.pop(seq_id, None)

    # -- the idle LRU -------------------------------------------------------------------------------------
    def park(self, group: int) -> None:
        """A cached group's last mapping went away: it waits, evictable, most recent last."""
        self.idle[group] = None

    def unpark(self, group: int) -> None:
        del self.idle[group]

    def evict(self, count: int) -> list[int]:
        """Drop the `count` least recently idle groups from the cache; the caller returns them to the pool."""
        out = []
        while len(out) < count and self.idle:
            group, _ = self.idle.popitem(last=False)
            page_hash, _ = self._entry_of.pop(group)
            del self._group_of[page_hash]
            out.append(group)
        self.evictions += len(out)
        if self.keeper is not None and out:
            self.keeper.let_go(out)
        return out

    def check(self, refs: list[int]) -> None:
        assert len(self._group_of) == len(self._entry_of), "prefix cache maps out of sync"
        for group, (page_hash, _) in self._entry_of.items():
            assert self._group_of.get(page_hash) == group, f"group {group} not under its hash"
        assert all(g in self._entry_of for g in self.idle), "an idle group is not cached"
        idle = {g for g in self._entry_of if refs[g] == 0}
        assert set(self.idle) == idle, "idle cached groups differ from cached groups no slot maps"
