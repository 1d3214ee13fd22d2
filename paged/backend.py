"""PagedAttention KV cache: per-sequence block tables over one block pool, copy-on-write, prefix caching, swap.

Real mode owns one tensor [2, num_layers, num_blocks, block_size, H_kv, D] (per-layer K and V are views);
accounting mode runs the same bookkeeping with no tensors.
"""
from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvlab.common.attention.metadata import BatchItem, PagedMetadata, base_metadata
from kvlab.common.errors import ConfigError, OutOfKVCache
from kvlab.common.kv.seam import Allocator, CacheStats, KVCache, KVShape, Storage
from kvlab.paged.block_pool import BlockPool, BlockPoolError
from kvlab.paged.prefix_cache import PrefixCache, chain_keys

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence


@dataclass(slots=True)
class SeqBlocks:
    seq: Sequence
    table: list[int]                                   # logical block j -> physical block id
    num_tokens: int = 0                                # tokens the sequence may hold (largest allocate)
    hashes: list[int] = field(default_factory=list)   # chained hashes of its leading registered full blocks


@dataclass(slots=True)
class SwappedSeq:
    blocks: SeqBlocks                # table holds the ids the sequence had; they are free now
    host: torch.Tensor | None        # [2, L, num_blocks, block_size, H_kv, D] on the CPU; None when accounting


def _timed(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: PagedKVCache, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.allocator_seconds += time.perf_counter() - start
    return wrapper


class PagedKVCache(Allocator, Storage):
    name = "paged"
    unit_name = "block"

    def __init__(self, config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> None:
        self.config, self.shape, self.accounting_only = config, shape, accounting_only
        self.block_size = self.tokens_per_unit = config.options_of("paged").block_size
        self.block_bytes = self.block_size * shape.bytes_per_token
        num_blocks = config.kv_cache_bytes // self.block_bytes
        if num_blocks == 0:
            raise ConfigError(f"kv_cache_bytes {config.kv_cache_bytes} is smaller than one block "
                              f"({self.block_bytes} bytes); raise kv_cache_bytes or lower block_size")
        self.prefix_cache = PrefixCache() if config.enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self.seqs: dict[int, SeqBlocks] = {}
        self.swapped: dict[int, SwappedSeq] = {}
        self.cow_copies = self.cow_remaps = self.prefix_hit_tokens = 0
        self.swapped_out_bytes = self.swapped_in_bytes = 0
        self.allocator_seconds = 0.0
        self.kv: torch.Tensor | None = None
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.dispatcher = None
        if not accounting_only:
            self._allocate_tensors(num_blocks)
            self.dispatcher = self._make_dispatcher()

    def _allocate_tensors(self, num_blocks: int) -> None:
        s = self.shape
        # zeros, not empty: padded kernel reads of unused slots must be finite (0 * NaN is NaN);
        # never an inference tensor, so it stays writable whether or not the caller is in inference mode
        with torch.inference_mode(False):
            self.kv = torch.zeros(2, s.num_layers, num_blocks, self.block_size, s.num_kv_heads, s.head_dim,
                                  dtype=s.torch_dtype, device=s.device)
            self.k_caches = list(self.kv[0])
            self.v_caches = list(self.kv[1])

    def _make_dispatcher(self):
        from kvlab.common.attention.dispatch import AttentionSpec, make_dispatcher
        device = torch.device(self.shape.device)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        spec = AttentionSpec(layout="paged", device=device.type, dtype=self.shape.dtype,
                             head_dim=self.shape.head_dim, num_q_heads=self.shape.num_q_heads,
                             num_kv_heads=self.shape.num_kv_heads, block_size=self.block_size,
                             compute_capability=capability)
        return make_dispatcher(spec, self.config.kernel)

    # -- capacity -------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.pool.num_blocks

    def num_free_units(self) -> int:
        return self.pool.num_free()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        entry = self.seqs.get(seq.seq_id)
        need = -(-num_tokens // self.block_size)
        if entry is not None:   # the per-step decode path: keep it cheap
            return max(0, need - len(entry.table)) + len(self._cow_targets(seq, entry, num_tokens))
        swapped = self.swapped.get(seq.seq_id)
        if swapped is not None:
            return max(need, len(swapped.blocks.table))
        hits = self._match_prefix(seq, num_tokens)
        # a hit on a block nobody holds takes it out of the free queue, so it still costs a free unit
        return need - len(hits) + sum(1 for block, _ in hits if self.pool.ref_counts[block] == 0)

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> bool:
        # the base rule, without the base-class call: the scheduler asks this for every sequence every step
        return self.units_needed(seq, num_tokens) + reserve_units <= self.pool.num_free()

    def _cow_targets(self, seq: Sequence, entry: SeqBlocks, num_tokens: int) -> list[int]:
        """Logical indices of shared blocks that this allocation's new tokens would write into."""
        if not self.pool.num_shared or num_tokens <= seq.num_computed_tokens:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min(len(entry.table), self._blocks_for(num_tokens))
        return [j for j in range(first, last) if self.pool.ref_counts[entry.table[j]] > 1]

    # -- lifecycle ------------------------------------------------------------------------------------
    @_timed
    def _take(self, seq: Sequence, num_tokens: int) -> int:
        entry = self.seqs.get(seq.seq_id)
        if entry is None:   # a swapped-out sequence is never in self.seqs
            if seq.seq_id in self.swapped:
                raise BlockPoolError(f"sequence {seq.seq_id} is swapped out; call swap_in before allocate")
            return self._allocate_new(seq, num_tokens)
        self._register_computed(seq, entry)
        cow = self._cow_targets(seq, entry, num_tokens)
        grow = -(-num_tokens // self.block_size) - len(entry.table)
        if grow > 0 or cow:   # most decode steps neither cross a block boundary nor touch a shared block
            grow = max(grow, 0)
            self._ensure_free(grow + len(cow), seq, num_tokens)
            partial = seq.num_computed_tokens % self.block_size != 0
            for j in cow:
                self._copy_on_write(entry, j,
                                    copy_content=partial and j == seq.num_computed_tokens // self.block_size)
            entry.table.extend(self.pool.allocate() for _ in range(grow))
        entry.num_tokens = max(entry.num_tokens, num_tokens)
        return 0

    def _allocate_new(self, seq: Sequence, num_tokens: int) -> int:
        hits = self._match_prefix(seq, num_tokens)
        fresh = self._blocks_for(num_tokens) - len(hits)
        revived = sum(1 for block, _ in hits if self.pool.ref_counts[block] == 0)
        self._ensure_free(fresh + revived, seq, num_tokens)
        for block, _ in hits:          # share first: hits must leave the free queue before fresh pops
            self.pool.share(block)
        table = [block for block, _ in hits] + [self.pool.allocate() for _ in range(fresh)]
        self.seqs[seq.seq_id] = SeqBlocks(seq, table, num_tokens, [h for _, h in hits])
        hit_tokens = len(hits) * self.block_size
        self.prefix_hit_tokens += hit_tokens
        return hit_tokens

    def _ensure_free(self, blocks: int, seq: Sequence, num_tokens: int) -> None:
        if blocks > self.pool.num_free():
            raise OutOfKVCache(f"sequence {seq.seq_id} needs {blocks} more KV blocks to hold {num_tokens} "
                               f"tokens but {self.pool.num_free()} are free; preempt or wait")

    def _copy_on_write(self, entry: SeqBlocks, j: int, copy_content: bool) -> None:
        old, new = entry.table[j], self.pool.allocate()
        if copy_content:
            if self.kv is not None:
                self.kv[:, :, new].copy_(self.kv[:, :, old])     # every layer, K and V, in one copy
            self.cow_copies += 1
        else:
            self.cow_remaps += 1                                  # shared but holds no tokens yet
        self.pool.release(old)
        entry.table[j] = new

    def _match_prefix(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """(block, hash) of leading cached full blocks, leaving at least the last token to recompute."""
        if self.prefix_cache is None:
            return []
        for entry in self.seqs.values():     # blocks computed since their sequence's last allocate
            self._register_computed(entry.seq, entry)
        limit = (min(num_tokens, seq.num_tokens) - 1) // self.block_size
        hits = []
        for block_hash, key in chain_keys(seq.token_ids, seq.adapter_id, self.block_size, limit,
                                          hash_fn=self.prefix_cache.hash_fn):
            block = self.prefix_cache.lookup(block_hash, key)
            if block is None:
                break
            hits.append((block, block_hash))
        return hits

    def _register_computed(self, seq: Sequence, entry: SeqBlocks) -> None:
        """Make the sequence's full, computed blocks findable by later requests."""
        if self.prefix_cache is None:
            return
        full = min(seq.num_computed_tokens, entry.num_tokens, seq.num_tokens) // self.block_size
        start = len(entry.hashes)
        parent = entry.hashes[-1] if entry.hashes else None
        keys = chain_keys(seq.token_ids, seq.adapter_id, self.block_size, full, start, parent,
                          self.prefix_cache.hash_fn)
        for j, (block_hash, key) in enumerate(keys, start):
            self.prefix_cache.insert(entry.table[j], block_hash, key)
            entry.hashes.append(block_hash)

    @_timed
    def free(self, seq: Sequence) -> None:
        if self.swapped.pop(seq.seq_id, None) is not None:
            return
        entry = self.seqs.pop(seq.seq_id, None)
        if entry is None:
            raise BlockPoolError(f"sequence {seq.seq_id} holds no KV blocks (freed twice, or never allocated)")
        self._register_computed(seq, entry)
        self._release_table(entry.table)

    def _release_table(self, table: list[int]) -> None:
        for block in reversed(table):   # tail first: cached tails are evicted before their prefixes
            self.pool.release(block)

    @_timed
    def fork(self, parent: Sequence, child: Sequence) -> None:
        entry = self.seqs.get(parent.seq_id)
        if entry is None:
            raise BlockPoolError(f"cannot fork sequence {parent.seq_id}: it holds no KV blocks")
        if self.holds(child) or child.seq_id in self.swapped:
            raise BlockPoolError(f"cannot fork into sequence {child.seq_id}: it already holds KV state")
        self._register_computed(parent, entry)
        for block in entry.table:
            self.pool.share(block)
        self.seqs[child.seq_id] = SeqBlocks(child, list(entry.table), entry.num_tokens, list(entry.hashes))

    @_timed
    def swap_out(self, seq: Sequence) -> None:
        entry = self.seqs.pop(seq.seq_id, None)
        if entry is None:
            raise BlockPoolError(f"cannot swap out sequence {seq.seq_id}: it holds no KV blocks")
        self._register_computed(seq, entry)
        host = None
        if self.kv is not None and entry.table:
            ids = torch.tensor(entry.table, dtype=torch.int64, device=self.kv.device)
            host = self.kv.index_select(2, ids).to("cpu")
        self.swapped_out_bytes += len(entry.table) * self.block_bytes
        self._release_table(entry.table)
        self.swapped[seq.seq_id] = SwappedSeq(entry, host)

    @_timed
    def _swap_in(self, seq: Sequence) -> None:
        swapped = self.swapped.get(seq.seq_id)
        if swapped is None:
            raise BlockPoolError(f"cannot swap in sequence {seq.seq_id}: it is not swapped out")
        entry = swapped.blocks
        self._ensure_free(len(entry.table), seq, entry.num_tokens)
        del self.swapped[seq.seq_id]
        entry.table = [self.pool.allocate() for _ in entry.table]
        if swapped.host is not None:
            ids = torch.tensor(entry.table, dtype=torch.int64, device=self.kv.device)
            self.kv.index_copy_(2, ids, swapped.host.to(self.kv.device))
        self.swapped_in_bytes += len(entry.table) * self.block_bytes
        self.seqs[seq.seq_id] = entry

    def holds(self, seq: Sequence) -> bool:
        """True while the sequence has blocks in the pool; a swapped-out copy is not held (the seam's rule)."""
        return seq.seq_id in self.seqs

    def block_table(self, seq: Sequence) -> list[int]:
        return list(self.seqs[seq.seq_id].table)

    # -- one step -------------------------------------------------------------------------------------
    def prepare(self, items: list[BatchItem]) -> PagedMetadata:
        if self.config.check_invariants:   # the kernel reads every block the tables name: check them first
            self.check_invariants()
        base = base_metadata(items, self.shape.device)
        rows = [self._table_row(it) for it in items]
        width = max((len(r) for r in rows), default=0)
        padded = [r + [0] * (width - len(r)) for r in rows]
        block_tables = torch.tensor(padded, dtype=torch.int32).reshape(len(items), width).to(self.shape.device)
        slot_mapping = self._slot_mapping(block_tables, base["input_positions"], base["query_lens"])
        return PagedMetadata(**base, block_tables=block_tables, slot_mapping=slot_mapping,
                             block_size=self.block_size)

    def _table_row(self, item: BatchItem) -> list[int]:
        entry = self.seqs.get(item.seq.seq_id)
        need = self._blocks_for(item.context_len)
        if entry is None or len(entry.table) < need:
            held = 0 if entry is None else len(entry.table)
            raise BlockPoolError(f"sequence {item.seq.seq_id} holds {held} blocks but this step needs {need}; "
                                 f"call allocate(seq, {item.context_len}) before prepare")
        return entry.table[:need]

    def _slot_mapping(self, block_tables: torch.Tensor, positions: torch.Tensor,
                      query_lens: torch.Tensor) -> torch.Tensor:
        """block_id * block_size + offset for every new token, with no Python loop over tokens."""
        rows = torch.repeat_interleave(torch.arange(len(query_lens), device=positions.device),
                                       query_lens.to(torch.int64))
        blocks = block_tables[rows, positions // self.block_size].to(torch.int64)
        return blocks * self.block_size + positions % self.block_size

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: PagedMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        if self.config.check_invariants and meta.num_tokens:
            assert int(meta.slot_mapping.max()) < k_cache.shape[0] * self.block_size, "slot outside the pool"
            assert int(meta.block_tables.max()) < k_cache.shape[0], "block table entry outside the pool"
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)
        if meta.num_tokens == 0:
            return torch.empty_like(q)
        return self.dispatcher.run(meta.phase, q, k_cache, v_cache, meta, scale)

    # -- observability --------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        used = self.pool.num_used()
        cached = self.prefix_cache
        return CacheStats(
            backend=self.name, unit_name=self.unit_name, tokens_per_unit=self.block_size,
            total_units=self.pool.num_blocks, used_units=used, free_units=self.pool.num_free(),
            live_tokens=sum(e.num_tokens for e in self.seqs.values()),
            allocated_token_slots=used * self.block_size,
            reserved_bytes=self.pool.num_blocks * self.block_bytes,
            mapped_bytes=self.pool.num_blocks * self.block_bytes,
            cow_copies=self.cow_copies, prefix_hit_tokens=self.prefix_hit_tokens,
            swapped_out_bytes=self.swapped_out_bytes, swapped_in_bytes=self.swapped_in_bytes,
            allocator_seconds=self.allocator_seconds,
            extra={
                "block_bytes": self.block_bytes,
                "shared_blocks": self.pool.num_shared,
                "cow_remaps": self.cow_remaps,
                "swapped_seqs": len(self.swapped),
                "prefix_cached_blocks": len(cached) if cached else 0,
                "prefix_hash_collisions": cached.collisions if cached else 0,
            },
        )

    def kernel_report(self) -> dict[str, Any]:
        return self.dispatcher.report() if self.dispatcher is not None else {}

    def check_invariants(self) -> None:
        refs = Counter(block for entry in self.seqs.values() for block in entry.table)
        for block, count in enumerate(self.pool.ref_counts):
            assert count == refs.get(block, 0), (
                f"block {block}: reference count {count} but {refs.get(block, 0)} block tables use it")
        self.pool.check_invariants()
        for seq_id, entry in self.seqs.items():
            assert len(entry.table) >= self._blocks_for(entry.num_tokens), f"sequence {seq_id}: table too short"
            assert len(entry.hashes) <= len(entry.table), f"sequence {seq_id}: more hashes than blocks"

    def close(self) -> None:
        self.kv = None
        self.k_caches, self.v_caches = [], []

    # -- the allocator contract: check and take in one call ------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        if not self.can_allocate(seq, num_tokens, reserve_units):
            return None
        return self._take(seq, num_tokens)

    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        if not self.can_swap_in(seq, reserve_units):
            return False
        self._swap_in(seq)
        return True

    def can_swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        return self.can_allocate(seq, seq.num_computed_tokens, reserve_units)

    def snapshot(self) -> dict:
        return {}


def build_paged(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    cache = PagedKVCache(config, shape, accounting_only)
    return KVCache(allocator=cache, storage=cache, shape=shape)
