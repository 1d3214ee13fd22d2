"""The paged backend (PagedAllocator + PagedStorage): sizing, growth, free, fork + copy-on-write, prefix
caching, swap, metadata, attention.

K/V written by the harness are a deterministic function of (token id, position, layer), so the expected
attention of any sequence can be recomputed densely from its token ids alone, whichever physical blocks
(own, forked, copied, prefix-hit, swapped back) hold them.
"""
import math
import random

import pytest
import torch
from fakes.reference import dense_attention

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError, OutOfKVCache
from kvlab.common.kv.seam import KVCache, NullStorage, create_cache
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.paged.allocator import PagedAllocator
from kvlab.paged.backend import build_paged
from kvlab.paged.block_pool import BlockPoolError
from kvlab.paged.probe import PROBE
from kvlab.paged.storage import PagedStorage

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, num_q_heads=4)
BLOCK = 4
BLOCK_BYTES = BLOCK * SHAPE.bytes_per_token


def make_cache(num_blocks=16, block_size=BLOCK, accounting=False, prefix=False, **overrides) -> KVCache:
    config = make_config(backend="paged", block_size=block_size, enable_prefix_caching=prefix,
                          kv_cache_bytes=num_blocks * block_size * SHAPE.bytes_per_token, **overrides)
    return build_paged(config, SHAPE, accounting_only=accounting)


def kv_of(token_ids: list[int], positions: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H_kv, D] K and V of tokens at positions, a fixed function of (token, position, layer)."""
    t = torch.tensor(token_ids, dtype=torch.float32)[:, None]
    p = torch.tensor(positions, dtype=torch.float32)[:, None]
    width = torch.arange(SHAPE.num_kv_heads * SHAPE.head_dim, dtype=torch.float32)[None, :]
    k = torch.sin(1.3 * t + 0.7 * p + layer + 0.1 * width)
    v = torch.cos(0.9 * t - 0.3 * p + 2 * layer + 0.2 * width)
    shape = (len(token_ids), SHAPE.num_kv_heads, SHAPE.head_dim)
    return k.reshape(shape), v.reshape(shape)


class Harness:
    """Drives a cache the way scheduler + runner + model do, and checks every attention output."""

    def __init__(self, cache: KVCache, seed: int = 0) -> None:
        self.cache, self.alloc, self.store = cache, cache.allocator, cache.storage
        self.gen = torch.Generator().manual_seed(seed)
        self.next_id = 0

    def new_seq(self, tokens: list[int], adapter: str = "") -> Sequence:
        self.next_id += 1
        return Sequence(self.next_id, str(self.next_id), tokens, max_tokens=100, adapter_id=adapter)

    def fork(self, parent: Sequence) -> Sequence:
        child = self.new_seq(parent.token_ids, parent.adapter_id)
        child.num_computed_tokens = parent.num_computed_tokens
        self.alloc.fork(parent, child)
        return child

    def step(self, work: list[tuple[Sequence, int]]) -> list[int]:
        """Compute the next `n` tokens of each sequence (n=None: up to its end); returns prefix hits."""
        items, hits = [], []
        for seq, n in work:
            target = seq.num_tokens if n is None else seq.num_computed_tokens + n
            held = self.alloc.holds(seq)
            hit = self.alloc.allocate(seq, target)
            if hit is None:   # the harness's refusal: the random workload frees sequences and goes on
                raise OutOfKVCache(f"no room for sequence {seq.seq_id}")
            if not held:
                seq.num_computed_tokens = hit
            hits.append(hit)
            items.append(BatchItem(seq, seq.num_computed_tokens, target - seq.num_computed_tokens))
        self.cache.check_invariants()
        if not self.cache.accounting_only:
            self._attend(items)
        for item in items:
            item.seq.num_computed_tokens = item.context_len
        return hits

    def _attend(self, items: list[BatchItem]) -> None:
        meta = self.store.prepare(items)
        tokens = [t for it in items for t in it.seq.token_ids[it.start:it.context_len]]
        positions = meta.input_positions.tolist()
        scale = SHAPE.head_dim ** -0.5
        for layer in range(SHAPE.num_layers):
            q = torch.randn(len(tokens), SHAPE.num_q_heads, SHAPE.head_dim, generator=self.gen)
            k, v = kv_of(tokens, positions, layer)
            out = self.store.attention(layer, q, k, v, meta, scale)
            row = 0
            for it in items:
                keys, values = kv_of(it.seq.token_ids[:it.context_len], list(range(it.context_len)), layer)
                expected = dense_attention(q[row:row + it.num_tokens], keys, values, scale)
                assert torch.allclose(out[row:row + it.num_tokens].double(), expected, atol=1e-5), "attention"
                row += it.num_tokens

    def decode(self, seqs: list[Sequence], token: int = 7) -> None:
        for seq in seqs:
            seq.append_token(token)
        self.step([(seq, 1) for seq in seqs])


# -- sizing and modes ---------------------------------------------------------------------------------------
def test_pool_is_sized_from_kv_cache_bytes():
    cache = make_cache(num_blocks=16)
    alloc, store = cache.allocator, cache.storage
    assert alloc.num_total_units() == 16 and alloc.num_free_units() == 16
    assert store.kv.shape == (2, SHAPE.num_layers, 16, BLOCK, SHAPE.num_kv_heads, SHAPE.head_dim)
    assert store.k_caches[1].shape == (16, BLOCK, SHAPE.num_kv_heads, SHAPE.head_dim)
    assert alloc.name == "paged" and alloc.unit_name == "block" and alloc.tokens_per_unit == BLOCK
    assert alloc.max_tokens_per_seq() == 16 * BLOCK
    assert isinstance(alloc, PagedAllocator) and isinstance(store, PagedStorage) and alloc.emit == store.move
    assert not hasattr(alloc, "storage")               # one way: the allocator's orders reach the storage by the cache


def test_kv_cache_bytes_below_one_block_is_a_config_error():
    config = make_config(block_size=BLOCK, kv_cache_bytes=BLOCK_BYTES - 1)
    with pytest.raises(ConfigError, match="smaller than one block"):
        build_paged(config, SHAPE)


def test_accounting_mode_owns_no_tensors_and_create_cache_builds_it():
    config = make_config(backend="paged", block_size=BLOCK, kv_cache_bytes=8 * BLOCK_BYTES)
    cache = create_cache(config, SHAPE, accounting_only=True)
    assert isinstance(cache.allocator, PagedAllocator) and cache.accounting_only
    assert type(cache.storage) is NullStorage and cache.allocator.emit == cache.storage.move
    assert not hasattr(cache.storage, "kv") and cache.storage.dispatcher is None
    assert cache.kernel_report() == {}


def test_kernel_report_names_the_torch_kernel_on_cpu():
    report = make_cache().kernel_report()
    assert report["kernels"] == {"prefill": "torch_paged", "decode": "torch_paged"}


# -- growth and free ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("accounting", [False, True], ids=["real", "accounting"])
def test_blocks_grow_one_at_a_time(accounting):
    h = Harness(make_cache(accounting=accounting))
    seq = h.new_seq([1] * 5)
    h.step([(seq, None)])
    assert len(h.alloc.block_table(seq)) == 2
    for n in range(6, 14):
        assert h.alloc.units_needed(seq, n) == (1 if n % BLOCK == 1 else 0)
        h.decode([seq])
        assert len(h.alloc.block_table(seq)) == math.ceil(n / BLOCK)
    assert h.alloc.stats().live_tokens == 13


def test_refused_allocate_leaves_state_unchanged():
    h = Harness(make_cache(num_blocks=4))
    cache = h.alloc
    a = h.new_seq([1] * 12)
    h.step([(a, None)])
    b = h.new_seq([2] * 8)
    assert cache.units_needed(b, 8) == 2
    before = cache.snapshot()
    assert cache.allocate(b, 8) is None
    assert not cache.holds(b) and cache.num_free_units() == 1 and cache.snapshot() == before
    assert cache.allocate(b, 4, reserve_units=1) is None and cache.snapshot() == before
    assert cache.allocate(b, 4) == 0 and cache.holds(b) and cache.num_free_units() == 0
    cache.check_invariants()


def test_free_returns_every_block_and_double_free_is_an_error():
    h = Harness(make_cache())
    seq = h.new_seq([3] * 9)
    h.step([(seq, None)])
    h.alloc.free(seq)
    assert h.alloc.num_free_units() == 16 and not h.alloc.holds(seq)
    with pytest.raises(BlockPoolError, match="holds no KV blocks"):
        h.alloc.free(seq)
    h.cache.check_invariants()


def test_prepare_needs_allocation_first():
    cache = make_cache().storage
    seq = Sequence(1, "1", [1, 2, 3], 4)
    with pytest.raises(BlockPoolError, match=r"call allocate\(seq, 3\) before prepare"):
        cache.prepare([BatchItem(seq, 0, 3)])


# -- metadata -----------------------------------------------------------------------------------------------
def test_prepare_builds_padded_tables_and_slot_mapping():
    h = Harness(make_cache())
    a, b = h.new_seq([1] * 9), h.new_seq([2] * 3)
    h.step([(a, 6), (b, None)])
    h.alloc.allocate(a, 9)
    a_table, b_table = h.alloc.block_table(a), h.alloc.block_table(b)
    meta = h.store.prepare([BatchItem(a, 6, 3), BatchItem(b, 2, 1)])
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.tolist() == [a_table[:3], b_table + [0, 0]]
    expected_slots = [a_table[p // BLOCK] * BLOCK + p % BLOCK for p in (6, 7, 8)] + [b_table[0] * BLOCK + 2]
    assert meta.slot_mapping.tolist() == expected_slots
    assert meta.phase == "prefill" and meta.block_size == BLOCK and meta.context_lens.tolist() == [9, 3]


def test_empty_batch():
    cache = make_cache().storage
    meta = cache.prepare([])
    assert meta.block_tables.shape == (0, 0) and meta.slot_mapping.numel() == 0
    q = torch.zeros(0, SHAPE.num_q_heads, SHAPE.head_dim)
    kv = torch.zeros(0, SHAPE.num_kv_heads, SHAPE.head_dim)
    assert cache.attention(0, q, kv, kv, meta, 1.0).shape == q.shape


# -- attention through the cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chunked_prefill_then_decode_matches_dense(block_size):
    h = Harness(make_cache(num_blocks=64, block_size=block_size))
    a, b, c = h.new_seq(list(range(10))), h.new_seq(list(range(20, 28))), h.new_seq([5])
    h.step([(a, 4), (b, None), (c, None)])      # a chunked; b ends on a block boundary for 4; c has length 1
    h.step([(a, None)])
    for _ in range(5):
        h.decode([a, b, c])
    assert h.alloc.stats().live_tokens == 15 + 13 + 6


@pytest.mark.triton_cpu
def test_explicit_triton_kernel_runs_the_steps():
    h = Harness(make_cache(kernel="triton_paged"))
    a, b = h.new_seq(list(range(6))), h.new_seq(list(range(10, 13)))
    h.step([(a, 5), (b, None)])
    h.step([(a, None)])
    h.decode([a, b])
    report = h.cache.kernel_report()
    assert report["kernels"] == {"prefill": "triton_paged", "decode": "triton_paged"}
    assert report["calls"]["triton_paged"] == 3 * SHAPE.num_layers and not report["runtime_fallbacks"]


# -- fork and copy-on-write ---------------------------------------------------------------------------------
def test_fork_shares_every_block():
    h = Harness(make_cache())
    parent = h.new_seq(list(range(6)))
    h.step([(parent, None)])
    child = h.fork(parent)
    assert h.alloc.block_table(child) == h.alloc.block_table(parent)
    assert all(h.alloc.pool.ref_counts[b] == 2 for b in h.alloc.block_table(parent))
    assert h.alloc.stats().extra["shared_blocks"] == 2
    h.cache.check_invariants()


def test_copy_on_write_copies_only_the_shared_partial_block():
    h = Harness(make_cache())
    parent = h.new_seq(list(range(6)))       # blocks: [0..3] full, [4, 5] partial
    h.step([(parent, None)])
    child = h.fork(parent)
    full, partial = h.alloc.block_table(parent)
    before = h.store.kv[:, :, partial].clone()

    child.append_token(100)
    assert h.alloc.units_needed(child, 7) == 1           # the copy-on-write block
    h.step([(child, 1)])
    child_table = h.alloc.block_table(child)
    assert child_table[0] == full and child_table[1] != partial
    assert h.alloc.stats().cow_copies == 1
    assert torch.equal(h.store.kv[:, :, partial], before)                     # parent untouched
    assert torch.equal(h.store.kv[:, :, child_table[1], :2], before[:, :, :2])  # prefix copied

    parent.append_token(200)
    assert h.alloc.units_needed(parent, 7) == 0          # sole owner now: writes in place
    h.step([(parent, 1)])
    assert h.alloc.block_table(parent) == [full, partial] and h.alloc.stats().cow_copies == 1
    k_parent, _ = kv_of([200], [6], 0)
    k_child, _ = kv_of([100], [6], 0)
    assert torch.equal(h.store.k_caches[0][partial, 2], k_parent[0])
    assert torch.equal(h.store.k_caches[0][child_table[1], 2], k_child[0])
    h.decode([parent, child])                            # both keep attending to their own history
    h.alloc.free(parent)
    h.decode([child])
    h.cache.check_invariants()


def test_fork_on_a_block_boundary_needs_no_copy():
    h = Harness(make_cache())
    parent = h.new_seq(list(range(8)))
    h.step([(parent, None)])
    child = h.fork(parent)
    h.decode([child, parent])
    assert h.alloc.stats().cow_copies == 0
    assert h.alloc.block_table(child)[:2] == h.alloc.block_table(parent)[:2]
    assert h.alloc.block_table(child)[2] != h.alloc.block_table(parent)[2]


def test_fork_errors():
    h = Harness(make_cache())
    parent, other = h.new_seq([1, 2]), h.new_seq([3])
    with pytest.raises(BlockPoolError, match="cannot fork sequence"):
        h.alloc.fork(parent, other)
    h.step([(parent, None), (other, None)])
    with pytest.raises(BlockPoolError, match="already holds KV state"):
        h.alloc.fork(parent, other)


# -- prefix caching -----------------------------------------------------------------------------------------
def test_prefix_hit_on_a_shared_prompt():
    h = Harness(make_cache(prefix=True))
    prompt = list(range(11))
    first = h.new_seq(prompt)
    assert h.step([(first, None)]) == [0]
    second = h.new_seq(prompt + [50])
    assert h.alloc.units_needed(second, 12) == 1         # 2 hit blocks held by `first`, 1 fresh
    assert h.step([(second, None)]) == [8]               # block aligned; only full, computed blocks
    assert h.alloc.block_table(second)[:2] == h.alloc.block_table(first)[:2]
    assert h.alloc.stats().prefix_hit_tokens == 8
    h.decode([first, second])


def test_prefix_hit_survives_free_and_caps_at_the_last_token():
    h = Harness(make_cache(prefix=True))
    prompt = list(range(8))                              # exactly two blocks
    first = h.new_seq(prompt)
    h.step([(first, None)])
    h.alloc.free(first)
    assert h.alloc.num_free_units() == 16
    again = h.new_seq(prompt)
    assert h.alloc.units_needed(again, 8) == 2           # the hit block leaves the free queue too
    assert h.step([(again, None)]) == [4]                # last token recomputed for its logits
    h.decode([again])


def test_no_prefix_hit_across_adapters_or_without_prefix_caching():
    h = Harness(make_cache(prefix=True))
    prompt = list(range(9))
    h.step([(h.new_seq(prompt, adapter="lora-a"), None)])
    assert h.step([(h.new_seq(prompt, adapter="lora-b"), None)]) == [0]
    assert h.step([(h.new_seq(prompt, adapter="lora-a"), None)]) == [8]
    plain = Harness(make_cache(prefix=False))
    plain.step([(plain.new_seq(prompt), None)])
    assert plain.step([(plain.new_seq(prompt), None)]) == [0]


def test_prefix_collision_is_detected_by_comparing_tokens():
    h = Harness(make_cache(prefix=True))
    h.alloc.prefix_cache.hash_fn = lambda key: 1234      # every block hashes alike
    h.step([(h.new_seq(list(range(9))), None)])
    other = h.new_seq(list(range(100, 109)))
    assert h.step([(other, None)]) == [0]
    assert h.alloc.stats().extra["prefix_hash_collisions"] >= 1
    h.decode([other])


def test_cached_blocks_are_evicted_under_pressure():
    h = Harness(make_cache(num_blocks=4, prefix=True))
    first = h.new_seq(list(range(12)))
    h.step([(first, None)])
    h.alloc.free(first)
    assert h.alloc.stats().extra["prefix_cached_blocks"] == 3
    other = h.new_seq(list(range(50, 66)))               # needs all four blocks
    h.step([(other, None)])
    assert h.alloc.stats().extra["prefix_cached_blocks"] == 0
    h.cache.check_invariants()


# -- swap ---------------------------------------------------------------------------------------------------
def test_swap_out_and_in_restores_contents():
    h = Harness(make_cache(num_blocks=6))
    seq = h.new_seq(list(range(10)))
    h.step([(seq, None)])
    h.alloc.swap_out(seq)
    assert h.alloc.num_free_units() == 6 and not h.alloc.holds(seq)   # swapped out: not resident (the seam)
    filler = h.new_seq(list(range(40, 64)))             # overwrites every block
    h.step([(filler, None)])
    before = h.alloc.snapshot()
    assert h.alloc.swap_in(seq) is False and h.alloc.snapshot() == before   # no room: nothing changed
    h.alloc.free(filler)
    assert h.alloc.swap_in(seq) is True and h.alloc.holds(seq)
    stats = h.alloc.stats()
    assert stats.swapped_out_bytes == stats.swapped_in_bytes == 3 * BLOCK_BYTES
    h.decode([seq])                                      # attention over the restored history
    h.cache.check_invariants()


def test_swap_in_accounting_mode_counts_bytes():
    h = Harness(make_cache(accounting=True))
    seq = h.new_seq(list(range(5)))
    h.step([(seq, None)])
    h.alloc.swap_out(seq)
    with pytest.raises(BlockPoolError, match="swap_in before allocate"):
        h.alloc.allocate(seq, 6)
    h.alloc.swap_in(seq)
    assert h.alloc.stats().swapped_in_bytes == 2 * BLOCK_BYTES
    h.alloc.swap_out(seq)
    h.alloc.free(seq)                                    # drops the host copy
    assert not h.alloc.holds(seq) and h.alloc.num_free_units() == 16


# -- stats and invariants -----------------------------------------------------------------------------------
def test_stats_fields():
    h = Harness(make_cache())
    seq = h.new_seq(list(range(6)))
    h.step([(seq, None)])
    stats = h.alloc.stats()
    assert (stats.total_units, stats.used_units, stats.free_units) == (16, 2, 14)
    assert stats.live_tokens == 6 and stats.allocated_token_slots == 8
    assert stats.reserved_bytes == 16 * BLOCK_BYTES and stats.allocator_seconds > 0


def test_check_invariants_catches_a_wrong_reference_count():
    h = Harness(make_cache())
    seq = h.new_seq([1, 2, 3])
    h.step([(seq, None)])
    h.alloc.pool.ref_counts[h.alloc.block_table(seq)[0]] += 1
    with pytest.raises(AssertionError, match="reference count 2 but 1 block tables use it"):
        h.cache.check_invariants()


def _random_workload(kv: KVCache, seed: int) -> list:
    """Random allocate/decode/fork/free/swap; returns a trace of observable state after every step."""
    rng = random.Random(seed)
    h = Harness(kv, seed)
    cache = kv.allocator
    live: list[Sequence] = []
    swapped: list[Sequence] = []
    trace = []
    for _ in range(120):
        action = rng.random()
        try:
            if action < 0.3 or not live:
                shared = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 8, 8, 8, 8]][rng.randrange(2)]
                seq = h.new_seq(shared[:rng.randint(0, 8)] + [rng.randrange(3) for _ in range(rng.randint(1, 5))])
                h.step([(seq, None)])
                live.append(seq)
            elif action < 0.6:
                h.decode(live, token=rng.randrange(3))
            elif action < 0.7:
                live.append(h.fork(rng.choice(live)))
            elif action < 0.8:
                seq = live.pop(rng.randrange(len(live)))
                cache.swap_out(seq)
                swapped.append(seq)
            elif action < 0.9 and swapped:
                if cache.swap_in(swapped[0]):
                    live.append(swapped.pop(0))
            else:
                cache.free(live.pop(rng.randrange(len(live))))
        except OutOfKVCache:
            for seq in live[rng.randrange(len(live)):] if live else []:
                cache.free(seq)
                live.remove(seq)
        cache.check_invariants()
        stats = cache.stats()
        trace.append((stats.used_units, stats.live_tokens, stats.cow_copies, stats.prefix_hit_tokens,
                      sorted(tuple(table) for table in cache.snapshot()["tables"].values())))
    return trace


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "prefix"])
def test_real_and_accounting_modes_make_identical_decisions(prefix):
    cache = make_cache(num_blocks=12, prefix=prefix)
    real = _random_workload(cache, seed=3)
    accounting = _random_workload(make_cache(num_blocks=12, prefix=prefix, accounting=True), seed=3)
    assert real == accounting
    stats = cache.allocator.stats()                      # the workload did exercise every path
    assert stats.cow_copies > 0 and stats.swapped_in_bytes > 0 and (stats.prefix_hit_tokens > 0) == prefix


# -- the probe the invariant tests use ----------------------------------------------------------------------
def test_probe_reads_tables_and_the_pool_and_catches_what_it_checks():
    h = Harness(make_cache(num_blocks=8))
    a, b = h.new_seq(list(range(6))), h.new_seq(list(range(20, 25)))
    h.step([(a, None), (b, None)])
    child = h.fork(a)
    h.alloc.swap_out(b)
    for seq in (a, child):
        stored = PROBE.read(h.cache, seq, seq.num_computed_tokens)
        want = torch.stack([torch.stack(kv_of(seq.token_ids[:6], list(range(6)), layer))
                            for layer in range(SHAPE.num_layers)])
        assert torch.equal(stored, want)
    live = {a.seq_id: a, child.seq_id: child}
    PROBE.check_structure(h.cache, live, {b.seq_id}, lambda *_: True)
    with pytest.raises(AssertionError, match="shared by unrelated sequences"):
        PROBE.check_structure(h.cache, live, {b.seq_id}, lambda *_: False)
    with pytest.raises(AssertionError, match="!= live"):
        PROBE.check_structure(h.cache, {a.seq_id: a}, {b.seq_id}, lambda *_: True)
    with pytest.raises(AssertionError, match="left after draining"):
        PROBE.check_drained(h.cache)
    for seq in (a, child, b):
        h.alloc.free(seq)
    PROBE.check_drained(h.cache)
    h.cache.close()
    PROBE.check_closed(h.cache)


# -- the real model through the cache -----------------------------------------------------------------------
def test_tiny_model_through_the_paged_cache_matches_reference_forward():
    from kvlab.common.presets import load_tiny
    model, _ = load_tiny("float32", "cpu", seed=0)
    shape = model.kv_shape()
    kv = build_paged(make_config(block_size=4, kv_cache_bytes=32 * 4 * shape.bytes_per_token), shape)
    cache, store = kv.allocator, kv.storage
    a, b = Sequence(1, "a", list(range(3, 13)), 8), Sequence(2, "b", list(range(40, 47)), 8)

    def run(work):
        items = []
        for seq, n in work:
            cache.allocate(seq, seq.num_computed_tokens + n)
            items.append(BatchItem(seq, seq.num_computed_tokens, n))
        meta = store.prepare(items)
        ids = torch.tensor([t for it in items for t in it.seq.token_ids[it.start:it.context_len]])
        logits = model(ids, meta.input_positions, store, meta)
        for row, it in enumerate(items):
            expected = model.reference_forward(torch.tensor([it.seq.token_ids[:it.context_len]]))[0, -1]
            assert torch.allclose(logits[row], expected, atol=1e-4), f"seq {it.seq.seq_id} at {it.context_len}"
            it.seq.num_computed_tokens = it.context_len
        return logits.argmax(-1).tolist()

    _, first_b = run([(a, 6), (b, 7)])                  # a chunked, b whole
    first_a, = run([(a, 4)])
    a.append_token(first_a)
    b.append_token(first_b)
    for _ in range(4):                                  # greedy decode of both
        next_a, next_b = run([(a, 1), (b, 1)])
        a.append_token(next_a)
        b.append_token(next_b)
    cache.check_invariants()


# -- measurement --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_measure_backend_allocate_and_free_cost(capsys):
    import time
    cache = make_cache(num_blocks=20_000, accounting=True).allocator
    seqs = [Sequence(i, str(i), [1] * 17, 4096) for i in range(64)]
    start = time.perf_counter()
    for seq in seqs:
        cache.allocate(seq, 17)
        seq.num_computed_tokens = 17
    for n in range(18, 18 + 1024):                       # 1024 decode steps of 64 sequences
        for seq in seqs:
            cache.allocate(seq, n)
            seq.num_computed_tokens = n
    allocate_us = (time.perf_counter() - start) / (64 * 1025) * 1e6
    blocks = cache.pool.num_used()
    start = time.perf_counter()
    for seq in seqs:
        cache.free(seq)
    free_us = (time.perf_counter() - start) / blocks * 1e6
    with capsys.disabled():
        print(f"\n[PagedAllocator, block 4] allocate(seq, n) {allocate_us:.2f} us per call (one per decode token), "
              f"free {free_us:.3f} us per block ({blocks} blocks)")
    assert cache.num_free_units() == 20_000
