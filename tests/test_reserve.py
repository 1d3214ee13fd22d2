"""The reserve baseline: contiguous first-fit regions, fragmentation, fork = copy, swap, real-mode layout."""
from __future__ import annotations

import random

import pytest
import torch

from kvlab.common.arena import Arena
from kvlab.common.attention.metadata import BatchItem
from kvlab.common.config import make_config
from kvlab.common.errors import OutOfKVCache
from kvlab.common.kv.seam import KVCache
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.reserve.allocator import ReserveAllocator
from kvlab.reserve.backend import build_reserve
from kvlab.reserve.storage import ReserveStorage

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, num_q_heads=4)      # 256 bytes per token


def cache(tokens: int, mode: str = "oracle", max_len: int = 64, real: bool = False) -> ReserveAllocator:
    """The allocator of a reserve cache (bookkeeping only; `whole_cache` for the storage too)."""
    return whole_cache(tokens, mode, max_len, real).allocator


def whole_cache(tokens: int, mode: str = "oracle", max_len: int = 64, real: bool = False) -> KVCache:
    config = make_config(backend="reserve", kv_cache_bytes=tokens * SHAPE.bytes_per_token, reserve_mode=mode,
                         max_model_len=max_len)
    return build_reserve(config, SHAPE, accounting_only=not real)


def seq(seq_id: int, prompt: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(range(prompt)), max_tokens)


def test_arena_first_fit_and_merging():
    arena = Arena(100)
    a, b, c = arena.take(10), arena.take(20), arena.take(30)
    assert (a, b, c) == (0, 10, 30) and arena.free_total == 40
    arena.give(b, 20)
    assert arena.take(15) == 10                   # first fit: the hole left by b
    arena.give(10, 15)
    arena.give(a, 10)                             # merges with the hole: [0, 30)
    arena.give(c, 30)                             # merges both sides: one extent
    arena.check()
    assert arena.starts == [0] and arena.lengths == [100]


def test_oracle_regions_fragment_externally():
    kv = cache(50)
    s = [seq(0, 6, 4), seq(1, 10, 10), seq(2, 6, 4)]        # regions of 10, 20, 10
    for x in s:
        kv.allocate(x, x.prompt_len)
    kv.free(s[1])
    big = seq(3, 20, 5)                                       # needs 25: 30 free but the largest hole is 20
    assert kv.num_free_units() == 30
    assert kv.allocate(big, 20) is None and not kv.holds(big)
    assert kv.num_free_units() == 30
    stats = kv.stats()
    assert stats.extra["largest_free_extent"] == 20
    assert stats.extra["external_fragmentation"] == pytest.approx(1 - 20 / 30)
    kv.check_invariants()


def test_max_mode_uses_aligned_slots_and_reports_waste():
    kv = cache(200, mode="max", max_len=64)                  # 3 slots of 64, 8 tokens unusable
    assert kv.num_total_units() == 192 and kv.max_tokens_per_seq() == 64
    a, b = seq(0, 10, 20), seq(1, 5, 5)
    kv.allocate(a, 10)
    kv.allocate(b, 5)
    assert [r[0] % 64 for r in kv.regions.spans.values()] == [0, 0]
    st = kv.stats()
    assert (st.live_tokens, st.allocated_token_slots, st.used_units) == (15, 128, 128)
    assert st.extra["reserved_waste_tokens"] == (30 - 10) + (10 - 5)     # slots the sequences will still fill
    assert st.extra["never_used_tokens"] == (64 - 30) + (64 - 10)
    assert kv.units_needed(a, 30) == 0 and kv.units_needed(a, 64) == 0 and kv.units_needed(a, 65) > 0
    assert kv.allocate(a, 65) is None and kv.allocate(a, 64) == 0


def test_watermark_reserve_is_respected():
    kv = cache(100)
    s = seq(0, 20, 20)                                        # region of 40
    assert kv.allocate(s, 20, reserve_units=61) is None and not kv.holds(s)
    assert kv.allocate(s, 20, reserve_units=60) == 0 and kv.holds(s)


def test_too_small_for_one_max_region():
    kv = cache(50, mode="max", max_len=64)
    assert kv.num_total_units() == 0 and kv.max_tokens_per_seq() == 0
    assert kv.allocate(seq(0, 2, 2), 2) is None


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    kv = cache(300)
    live: dict[int, Sequence] = {}
    swapped: dict[int, Sequence] = {}
    for i in range(2000):
        op = rng.random()
        if op < 0.4:
            s = seq(i, rng.randrange(1, 30), rng.randrange(1, 30))
            if kv.allocate(s, s.prompt_len) is not None:
                live[i] = s
        elif op < 0.6 and live:
            kv.free(live.pop(rng.choice(list(live))))
        elif op < 0.7 and live:
            parent = live[rng.choice(list(live))]
            child = seq(10_000 + i, parent.prompt_len, parent.max_tokens)
            try:
                kv.fork(parent, child)
                live[child.seq_id] = child
            except OutOfKVCache:
                pass
        elif op < 0.8 and live:
            s = live.pop(rng.choice(list(live)))
            s.num_computed_tokens = kv.regions.held[s.seq_id]
            kv.swap_out(s)
            swapped[s.seq_id] = s
        elif op < 0.9 and swapped:
            s = swapped[rng.choice(list(swapped))]
            if kv.swap_in(s):
                live[s.seq_id] = swapped.pop(s.seq_id)
        elif live:
            s = live[rng.choice(list(live))]
            grow = min(kv.regions.held[s.seq_id] + 1, s.final_len)
            assert kv.allocate(s, grow) == 0
        kv.check_invariants()
    for s in [*live.values(), *swapped.values()]:
        kv.free(s)
    st = kv.stats()
    assert st.used_units == 0 and st.live_tokens == 0 and not kv.swapped
    kv.check_invariants()


def _write(store: ReserveStorage, s: Sequence) -> None:
    """Write a recognisable value (seq id, position) for every token of `s` at prepare()'s write_index."""
    meta = store.prepare([BatchItem(s, 0, s.num_tokens)])
    for layer in range(SHAPE.num_layers):
        values = meta.input_positions.float()[:, None, None] + 1000 * (s.seq_id + 1) + 100 * layer
        k = values.expand(-1, SHAPE.num_kv_heads, SHAPE.head_dim).contiguous()
        store.k[layer].index_copy_(0, meta.write_index, k)
        store.v[layer].index_copy_(0, meta.write_index, -k)


@pytest.mark.parametrize("mode", ["max", "oracle"])
def test_real_mode_rows_view_regions(mode):
    whole = whole_cache(160, mode=mode, max_len=32, real=True)
    kv, store = whole.allocator, whole.storage
    a, b = seq(0, 5, 10), seq(1, 7, 10)
    for s in (a, b):
        kv.allocate(s, s.prompt_len)
        _write(store, s)
    meta = store.prepare([BatchItem(a, 0, 5), BatchItem(b, 0, 7)])
    for layer in range(SHAPE.num_layers):
        for s, slot in zip((a, b), meta.slots.tolist()):
            rows = store.k_rows[layer][slot, :s.num_tokens, 0, 0]
            assert rows.tolist() == [1000 * (s.seq_id + 1) + 100 * layer + p for p in range(s.num_tokens)]
    if mode == "oracle":
        assert meta.slots.tolist() == [0, 15]          # slot = start token (regions of 15 and 17)
    else:
        assert meta.slots.tolist() == [0, 1]


def test_real_mode_fork_copies_and_swap_round_trips():
    whole = whole_cache(120, real=True)
    kv, store = whole.allocator, whole.storage
    a = seq(0, 6, 4)
    kv.allocate(a, 6)
    _write(store, a)
    child = seq(1, 6, 4)
    kv.fork(a, child)
    start_a, start_c = kv.regions.spans[0][0], kv.regions.spans[1][0]
    assert start_a != start_c
    assert torch.equal(store.k[0][start_c:start_c + 6], store.k[0][start_a:start_a + 6])
    assert kv.stats().used_units == 20                 # no sharing: two full regions
    before = store.k[1][start_a:start_a + 6].clone()
    a.num_computed_tokens = 6
    kv.swap_out(a)
    blocker = seq(2, 3, 2)                              # takes the hole: a comes back elsewhere
    kv.allocate(blocker, 3)
    assert kv.swap_in(a)
    new_start = kv.regions.spans[0][0]
    assert new_start != start_a
    assert torch.equal(store.k[1][new_start:new_start + 6], before)
    st = kv.stats()
    assert st.swapped_out_bytes == st.swapped_in_bytes == 6 * SHAPE.bytes_per_token
    for s in (a, child, blocker):
        kv.free(s)
    assert kv.stats().used_units == 0
    kv.check_invariants()


def test_swap_in_refused_keeps_the_host_copy():
    whole = whole_cache(30, real=True)
    kv = whole.allocator
    a = seq(0, 10, 10)                                  # region of 20
    kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.swap_out(a)
    other = seq(1, 10, 5)                               # region of 15: leaves 15 < 20
    kv.allocate(other, 10)
    assert not kv.swap_in(a) and not kv.holds(a)
    assert 0 in whole.storage.saved                     # the storage keeps the host copy, by seq_id
    kv.free(other)
    assert kv.swap_in(a)
    assert kv.holds(a) and kv.regions.held[0] == 10


def test_kernel_report_names_the_contiguous_kernel():
    kv = whole_cache(64, real=True)
    assert kv.kernel_report()["kernels"]["decode"]
