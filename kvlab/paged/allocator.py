"""The paged allocator: per-sequence block tables over one block pool, copy-on-write, prefix caching, swap.

Bookkeeping only, no tensors and no storage. Whatever must happen to the data (copy a block on write, save a
sequence's blocks to the host on swap-out, restore them on swap-in) is emitted as an order (common/kv/types.py)
that the cache hands to its storage; an accounting-only cache discards them.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import ConfigError
from kvlab.common.kv.seam import Allocator, timed, timed_allocate
from kvlab.common.kv.types import CacheStats, CopyKV, DropSavedKV, KVShape, RestoreKV, SaveKV
from kvlab.paged.block_pool import BlockPool, BlockPoolError
from kvlab.paged.block_table import DROPPED, SeqBlocks, blocks_for, live
from kvlab.paged.prefix_cache import PrefixCache, PrefixIndex

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence


def cow_targets(pool: BlockPool, entry: SeqBlocks, computed: int, num_tokens: int, block_size: int) -> list[int]:
    """Logical indices of shared blocks that an allocation's new tokens (computed..num_tokens) would write."""
    if not pool.num_shared or num_tokens <= computed:
        return []
    last = min(len(entry.table), blocks_for(num_tokens, block_size))
    return [j for j in range(computed // block_size, last) if pool.ref_counts[entry.table[j]] > 1]


class PagedAllocator(Allocator):
    name = "paged"
    unit_name = "block"

    def __init__(self, config: EngineConfig, shape: KVShape) -> None:
        self.block_size = self.tokens_per_unit = config.options_of("paged").block_size
        self.block_bytes = self.block_size * shape.bytes_per_token
        num_blocks = config.kv_cache_bytes // self.block_bytes
        if num_blocks == 0:
            raise ConfigError(f"kv_cache_bytes {config.kv_cache_bytes} is smaller than one block "
                              f"({self.block_bytes} bytes); raise kv_cache_bytes or lower block_size")
        self.window = shape.sliding_window          # None: full attention, no block is ever dropped
        self.dropped_blocks = 0
        if self.window is not None and config.enable_prefix_caching:
            raise ConfigError("paged: prefix caching with a sliding-window model is not supported (the window "
                              "frees the leading blocks a prefix hit would share); disable one of them")
        self.prefix_cache = PrefixCache() if config.enable_prefix_caching else None
        self.prefix = PrefixIndex(self.prefix_cache, self.block_size)
        self.plain = self.prefix_cache is None and self.window is None   # allocate's fast path applies
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self.seqs: dict[int, SeqBlocks] = {}
        self.swapped: dict[int, SeqBlocks] = {}      # table: the ids it had, free now (the storage keeps its KV)
        self.cow_copies = self.cow_remaps = self.prefix_hit_tokens = 0
        self.swapped_out_bytes = self.swapped_in_bytes = 0
        self.allocator_seconds = 0.0

    # -- capacity -------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.pool.num_blocks

    def num_free_units(self) -> int:
        return self.pool.num_free()

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        entry = self.seqs.get(seq.seq_id)
        need = blocks_for(num_tokens, self.block_size)
        if entry is not None:   # the per-step decode path: keep it cheap
            cow = cow_targets(self.pool, entry, seq.num_computed_tokens, num_tokens, self.block_size)
            return max(0, need - len(entry.table)) + len(cow)
        swapped = self.swapped.get(seq.seq_id)
        if swapped is not None:
            return max(need - swapped.table.count(DROPPED), len(live(swapped.table)))
        hits = self.prefix.match(seq, num_tokens, self.seqs.values())
        # a hit on a block nobody holds takes it out of the free queue, so it still costs a free unit
        return need - len(hits) + sum(1 for block, _ in hits if self.pool.ref_counts[block] == 0)

    # -- lifecycle ------------------------------------------------------------------------------------
    @timed_allocate
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        entry = self.seqs.get(seq.seq_id)
        if (entry is not None and self.plain and not self.pool.num_shared
                and num_tokens <= len(entry.table) * self.block_size):
            # the per-step decode path (no prefix cache, window or shared block): the blocks are already there
            if reserve_units and reserve_units > self.pool.num_free():
                return None
            if num_tokens > entry.num_tokens:
                entry.num_tokens = num_tokens
            return 0
        # units_needed counts every block either path takes, so neither can run out halfway
        if self.units_needed(seq, num_tokens) + reserve_units > self.pool.num_free():
            return None
        if entry is None:   # a swapped-out sequence is never in self.seqs
            return self._admit(seq, num_tokens)
        self._grow(seq, entry, num_tokens)
        return 0

    @timed
    def hold_in_place(self, seqs: list[Sequence], targets: list[int], i: int) -> int:
        """allocate's decode path as one loop: each target within the blocks its sequence already has."""
        if not self.plain or self.pool.num_shared:
            return i
        entries, block_size = self.seqs, self.block_size
        for j in range(i, len(seqs)):
            entry, tokens = entries.get(seqs[j].seq_id), targets[j]
            if entry is None or tokens > len(entry.table) * block_size:
                return j
            if tokens > entry.num_tokens:
                entry.num_tokens = tokens
        return len(seqs)

    def _admit(self, seq: Sequence, num_tokens: int) -> int:
        if seq.seq_id in self.swapped:
            raise BlockPoolError(f"sequence {seq.seq_id} is swapped out; call swap_in before allocate")
        hits = self.prefix.match(seq, num_tokens, self.seqs.values())
        for block, _ in hits:          # share first: hits must leave the free queue before fresh pops
            self.pool.share(block)
        fresh = blocks_for(num_tokens, self.block_size) - len(hits)
        table = [block for block, _ in hits] + [self.pool.allocate() for _ in range(fresh)]
        self.seqs[seq.seq_id] = SeqBlocks(seq, table, num_tokens, [h for _, h in hits])
        hit_tokens = len(hits) * self.block_size
        self.prefix_hit_tokens += hit_tokens
        return hit_tokens

    def _grow(self, seq: Sequence, entry: SeqBlocks, num_tokens: int) -> None:
        self.prefix.register(seq, entry)
        computed = seq.num_computed_tokens
        if self.window is not None:
            self._drop_outside_window(entry, computed)
        cow = cow_targets(self.pool, entry, computed, num_tokens, self.block_size)
        grow = blocks_for(num_tokens, self.block_size) - len(entry.table)
        if grow > 0 or cow:   # most decode steps neither cross a block boundary nor touch a shared block
            partial = computed % self.block_size     # tokens already in the block this step writes into
            for j in cow:
                self._copy_on_write(entry, j, partial if j == computed // self.block_size else 0)
            entry.table.extend(self.pool.allocate() for _ in range(max(grow, 0)))
        entry.num_tokens = max(entry.num_tokens, num_tokens)

    def _drop_outside_window(self, entry: SeqBlocks, computed: int) -> None:
        """Sliding window: this step's queries start at `computed`, so they read keys from computed - W + 1 on;
        blocks wholly below that go back to the pool (their table entries become DROPPED). A sequence then holds
        at most ceil(W / block_size) + 1 blocks during decode."""
        first_needed = max(computed - self.window + 1, 0)
        end = min(first_needed // self.block_size, len(entry.table))
        for j in range(entry.dropped, end):
            self.pool.release(entry.table[j])
            entry.table[j] = DROPPED
            self.dropped_blocks += 1
        entry.dropped = max(entry.dropped, end)

    def _copy_on_write(self, entry: SeqBlocks, j: int, held: int) -> None:
        """Give the sequence its own block j; the `held` tokens already in it are copied (0: nothing to copy)."""
        old, new = entry.table[j], self.pool.allocate()
        if held:
            self.emit(CopyKV(old, new, held))
            self.cow_copies += 1
        else:
            self.cow_remaps += 1                                  # shared but holds no tokens yet
        self.pool.release(old)
        entry.table[j] = new

    @timed
    def free(self, seq: Sequence) -> None:
        if self.swapped.pop(seq.seq_id, None) is not None:
            self.emit(DropSavedKV(seq.seq_id))
            return
        entry = self.seqs.pop(seq.seq_id, None)
        if entry is None:
            raise BlockPoolError(f"sequence {seq.seq_id} holds no KV blocks (freed twice, or never allocated)")
        self.prefix.register(seq, entry)
        self.pool.release_all(live(entry.table))

    @timed
    def fork(self, parent: Sequence, child: Sequence) -> None:
        entry = self.seqs.get(parent.seq_id)
        if entry is None:
            raise BlockPoolError(f"cannot fork sequence {parent.seq_id}: it holds no KV blocks")
        if self.holds(child) or child.seq_id in self.swapped:
            raise BlockPoolError(f"cannot fork into sequence {child.seq_id}: it already holds KV state")
        self.prefix.register(parent, entry)
        for block in live(entry.table):
            self.pool.share(block)
        self.seqs[child.seq_id] = SeqBlocks(child, list(entry.table), entry.num_tokens, list(entry.hashes),
                                               entry.dropped)

    @timed
    def swap_out(self, seq: Sequence) -> None:
        entry = self.seqs.pop(seq.seq_id, None)
        if entry is None:
            raise BlockPoolError(f"cannot swap out sequence {seq.seq_id}: it holds no KV blocks")
        self.prefix.register(seq, entry)
        kept = live(entry.table)
        self.emit(SaveKV(seq.seq_id, kept, len(kept) * self.block_size))
        self.swapped_out_bytes += len(kept) * self.block_bytes
        self.pool.release_all(kept)
        self.swapped[seq.seq_id] = entry

    @timed
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        if seq.seq_id not in self.swapped:
            raise BlockPoolError(f"cannot swap in sequence {seq.seq_id}: it is not swapped out")
        if self.units_needed(seq, seq.num_computed_tokens) + reserve_units > self.pool.num_free():
            return False
        entry = self.swapped.pop(seq.seq_id)
        entry.table = [DROPPED if b == DROPPED else self.pool.allocate() for b in entry.table]
        kept = live(entry.table)
        self.emit(RestoreKV(seq.seq_id, kept, len(kept) * self.block_size))
        self.swapped_in_bytes += len(kept) * self.block_bytes
        self.seqs[seq.seq_id] = entry
        return True

    def holds(self, seq: Sequence) -> bool:
        """True while the sequence has blocks in the pool; a swapped-out copy is not held (the seam's rule)."""
        return seq.seq_id in self.seqs

    def block_table(self, seq: Sequence) -> list[int]:
        """Physical blocks of the sequence's logical blocks, in order; [] when it holds none."""
        entry = self.seqs.get(seq.seq_id)
        return [] if entry is None else list(entry.table)

    # -- observability --------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        used, cached = self.pool.num_used(), self.prefix_cache
        reserved = self.pool.num_blocks * self.block_bytes
        return CacheStats(
            backend=self.name, unit_name=self.unit_name, tokens_per_unit=self.block_size,
            total_units=self.pool.num_blocks, used_units=used, free_units=self.pool.num_free(),
            live_tokens=sum(e.num_tokens for e in self.seqs.values()), allocated_token_slots=used * self.block_size,
            reserved_bytes=reserved, mapped_bytes=reserved, cow_copies=self.cow_copies,
            prefix_hit_tokens=self.prefix_hit_tokens, swapped_out_bytes=self.swapped_out_bytes,
            swapped_in_bytes=self.swapped_in_bytes, allocator_seconds=self.allocator_seconds,
            extra={
                "block_bytes": self.block_bytes,
                "shared_blocks": self.pool.num_shared,
                "cow_remaps": self.cow_remaps,
                "window_dropped_blocks": self.dropped_blocks,
                "swapped_seqs": len(self.swapped),
                "prefix_cached_blocks": len(cached) if cached else 0,
                "prefix_hash_collisions": cached.collisions if cached else 0,
            },
        )

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the invariant tests: every table, reference count and the free queue."""
        return {
            "block_size": self.block_size,
            "num_blocks": self.pool.num_blocks,
            "tables": {sid: list(e.table) for sid, e in self.seqs.items()},
            "num_tokens": {sid: e.num_tokens for sid, e in self.seqs.items()},
            "swapped": sorted(self.swapped),
            "ref_counts": list(self.pool.ref_counts),
            "free_blocks": self.pool.free_blocks(),
            "shared_blocks": self.pool.num_shared,
            "prefix_caching": self.prefix_cache is not None,
            "prefix_cached_blocks": len(self.prefix_cache) if self.prefix_cache is not None else 0,
        }

    def check_invariants(self) -> None:
        refs = Counter(block for entry in self.seqs.values() for block in live(entry.table))
        for block, count in enumerate(self.pool.ref_counts):
            assert count == refs.get(block, 0), (
                f"block {block}: reference count {count} but {refs.get(block, 0)} block tables use it")
        self.pool.check_invariants()
        for seq_id, entry in self.seqs.items():
            need = blocks_for(entry.num_tokens, self.block_size)
            assert len(entry.table) >= need, f"sequence {seq_id}: table too short"
            assert len(entry.hashes) <= len(entry.table), f"sequence {seq_id}: more hashes than blocks"
