"""The contiguous SDPA kernel's decode batching: the grouping rule, correctness against dense attention with
garbage past every context, the readable bound (a real host-VM cache with unmapped pages, in a subprocess) and
the reserve backend's bound."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fakes.reference import contiguous_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.common.attention.contiguous import PLAN_KEY, RECOMPUTES_KEY, contiguous_attention_sdpa, group_decode
from kvlab.common.attention.metadata import BatchItem, ContiguousMetadata, base_metadata
from kvlab.common.config import make_config
from kvlab.common.errors import RequestError
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.reserve.backend import build_reserve

ROOT = Path(__file__).resolve().parents[1]
NO_CAP = 10**9


def _pages(n: int, tpp: int) -> int:
    return -(-n // tpp) * tpp


# -- the grouping rule --------------------------------------------------------------------------------------------
def test_readable_equal_to_context_gives_the_equal_length_groups():
    contexts = [9, 30, 9, 1, 30, 9, 7]
    groups = group_decode(contexts, contexts, list(range(len(contexts))), NO_CAP)
    assert sorted(sorted(contexts[b] for b in g.items) for g in groups) == [[1], [7], [9, 9, 9], [30, 30]]
    assert all(not g.masked and g.length == contexts[g.items[0]] for g in groups)


def test_sequences_ending_in_the_same_page_share_a_call():
    contexts = [5, 30, 33, 64, 97, 100, 128, 32]
    readable = [_pages(c, 32) for c in contexts]
    groups = group_decode(contexts, readable, list(range(len(contexts))), NO_CAP)
    assert [(sorted(contexts[b] for b in g.items), g.length, g.masked) for g in groups] == [
        ([5, 30, 32], 32, True), ([33, 64], 64, True), ([97, 100, 128], 128, True)]


def test_a_group_never_reaches_past_a_members_readable_length():
    contexts, readable = [10, 20, 25, 40], [100, 24, 60, 60]   # 20 may be read only to 24: 25 cannot join it
    groups = group_decode(contexts, readable, [3, 2, 1, 0], NO_CAP)
    assert [sorted(contexts[b] for b in g.items) for g in groups] == [[10, 20], [25, 40]]
    assert [g.items for g in groups] == [[1, 0], [3, 2]]          # by slot: 20 sits in slot 2, 10 in slot 3


def test_padding_that_costs_more_than_a_call_opens_a_group():
    contexts, readable = [10, 20, 1000], [2000] * 3
    assert len(group_decode(contexts, readable, [0, 1, 2], NO_CAP)) == 1
    groups = group_decode(contexts, readable, [0, 1, 2], call_cost_tokens=100)   # 2 x 980 padded > 100
    assert [sorted(contexts[b] for b in g.items) for g in groups] == [[10, 20], [1000]]


def test_a_readable_length_below_the_context_is_refused():
    with pytest.raises(RequestError, match="readable length 8 is shorter than its context 9; the cache.s prepare"):
        group_decode([9], [8], [0], NO_CAP)


def _fewest_calls(contexts: list[int], readable: list[int]) -> int:
    """Minimum stabbing points of the intervals [context, readable] (greedy by right end)."""
    point, count = -1, 0
    for lo, hi in sorted(zip(contexts, readable), key=lambda p: p[1]):
        if lo > point:
            point, count = hi, count + 1
    return count


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 200)), min_size=1, max_size=24),
       st.integers(0, 400))
def test_groups_cover_every_item_once_within_its_bounds(pairs, cost):
    contexts = [c for c, _ in pairs]
    readable = [c + extra for c, extra in pairs]
    slots = random.Random(len(pairs)).sample(range(100), len(pairs))
    groups = group_decode(contexts, readable, slots, cost)
    assert sorted(b for g in groups for b in g.items) == list(range(len(pairs)))
    for g in groups:
        assert g.length == max(contexts[b] for b in g.items) <= min(readable[b] for b in g.items)
        assert g.masked == any(contexts[b] < g.length for b in g.items)
        assert [slots[b] for b in g.items] == sorted(slots[b] for b in g.items)
    if cost >= 24 * 500:   # the cap never binds: as few calls as the bounds allow
        assert len(groups) == _fewest_calls(contexts, readable)
    assert len(group_decode(contexts, contexts, slots, cost)) == len(set(contexts))


# -- correctness against dense attention ----------------------------------------------------------------------------
def _batch(query_lens, context_lens, readable, num_heads, num_kv_heads, dtype, seed, max_len=160,
           consecutive=False):
    """A contiguous cache of random K/V (garbage past every context too), random or consecutive slots."""
    g = torch.Generator().manual_seed(seed)
    items = [BatchItem(Sequence(i, str(i), [0] * c, 1), c - n, n)
             for i, (n, c) in enumerate(zip(query_lens, context_lens))]
    base = base_metadata(items)
    num_slots = len(items) + 3
    slots = torch.arange(2, 2 + len(items)) if consecutive else torch.randperm(num_slots, generator=g)[:len(items)]
    meta = ContiguousMetadata(**base, slots=slots,
                              readable_lens=None if readable is None else torch.tensor(readable))
    k_cache = torch.randn(num_slots, max_len, num_kv_heads, 32, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, max_len, num_kv_heads, 32, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), num_heads, 32, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


def _expected(q, k_cache, v_cache, meta):
    return contiguous_reference(q, k_cache, v_cache, meta.slots, meta.query_lens, meta.context_lens, 32 ** -0.5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_length_decode_matches_dense_attention(dtype, tol, num_heads, num_kv_heads, seed):
    rng = random.Random(seed)
    tpp = rng.choice([1, 8, 32])
    contexts = [rng.randint(1, 150) for _ in range(rng.randint(1, 20))]
    readable = [min(160, _pages(c, tpp) + rng.choice([0, 0, tpp])) for c in contexts]
    query_lens = [1] * len(contexts)
    if seed % 2:   # a prefill chunk among the decodes (chunked prefill)
        query_lens[0] = min(contexts[0], 5)
    q, k_cache, v_cache, meta = _batch(query_lens, contexts, readable, num_heads, num_kv_heads, dtype, seed,
                                       consecutive=seed == 2)
    out = contiguous_attention_sdpa(q, k_cache, v_cache, meta, 32 ** -0.5)
    torch.testing.assert_close(out.double(), _expected(q, k_cache, v_cache, meta), rtol=tol, atol=tol)
    assert RECOMPUTES_KEY not in (meta.workspace or {})


def _count_sdpa_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def test_a_decode_batch_of_sixteen_lengths_in_two_pages_is_two_calls(monkeypatch):
    contexts = [136 + 8 * i for i in range(16)]                 # 136..256: pages of 128 end at 256 (and 256)
    q, k_cache, v_cache, meta = _batch([1] * 16, contexts, [_pages(c, 128) for c in contexts], 4, 2,
                                       torch.float32, 0, max_len=256, consecutive=True)
    calls = _count_sdpa_calls(monkeypatch)
    out = contiguous_attention_sdpa(q, k_cache, v_cache, meta, 32 ** -0.5)
    assert calls == [16]                                         # all 16 end in the second page
    torch.testing.assert_close(out.double(), _expected(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)
    plan = meta.plans[PLAN_KEY]
    contiguous_attention_sdpa(q, k_cache, v_cache, meta, 32 ** -0.5)   # the next layer reuses the plan
    assert meta.plans[PLAN_KEY] is plan and calls == [16, 16]
    assert plan.decode[0].first_slot == 2                       # consecutive slots: a view, no gather


def test_without_a_readable_bound_only_equal_lengths_share_a_call(monkeypatch):
    contexts = [40, 41, 40, 77, 41, 40]
    q, k_cache, v_cache, meta = _batch([1] * 6, contexts, None, 4, 2, torch.float32, 1)
    calls = _count_sdpa_calls(monkeypatch)
    out = contiguous_attention_sdpa(q, k_cache, v_cache, meta, 32 ** -0.5)
    assert sorted(calls) == [1, 2, 3]
    torch.testing.assert_close(out.double(), _expected(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)


def test_non_finite_garbage_past_a_context_is_recomputed_not_returned(caplog):
    contexts = [20, 25, 31, 32]
    q, k_cache, v_cache, meta = _batch([1] * 4, contexts, [32] * 4, 4, 2, torch.float32, 2)
    for slot, ctx in zip(meta.slots.tolist(), contexts):
        v_cache[slot, ctx:] = float("nan")                       # uninitialised memory past the context
        k_cache[slot, ctx:] = float("inf")
    out = contiguous_attention_sdpa(q, k_cache, v_cache, meta, 32 ** -0.5)
    torch.testing.assert_close(out.double(), _expected(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)
    assert meta.workspace[RECOMPUTES_KEY] == 1 and "recomputed one sequence at a time" in caplog.text


# -- the bound the backends promise -----------------------------------------------------------------------------------
def test_reserve_metadata_bounds_reads_by_the_region():
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=16, num_q_heads=4)
    for mode, expected in (("max", [64, 64, 64]), ("oracle", [13, 30, 60])):
        kv = build_reserve(make_config(backend="reserve", reserve_mode=mode, max_model_len=64,
                                       kv_cache_bytes=8 * 64 * shape.bytes_per_token, max_num_seqs=4,
                                       max_num_batched_tokens=256), shape)
        cache = kv.storage
        seqs = [Sequence(i, str(i), [0] * n, max_tokens=m) for i, (n, m) in enumerate(((5, 8), (20, 10), (40, 20)))]
        for s in seqs:
            kv.allocator.allocate(s, s.num_tokens)
        meta = cache.prepare([BatchItem(s, s.num_tokens - 1, 1) for s in seqs])
        assert meta.readable_lens.tolist() == expected
        g = torch.Generator().manual_seed(0)
        q = torch.randn(3, 4, 16, generator=g)
        out = cache.attention(0, q, torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g),
                              meta, 0.25)
        ref = contiguous_reference(q, cache.k_rows[0], cache.v_rows[0], meta.slots, meta.query_lens,
                                   meta.context_lens, 0.25)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_mixed_decode_on_a_real_host_vm_cache_never_touches_an_unmapped_page():
    """In a subprocess: a real host-VM cache (4 KiB pages, 32 tokens each) whose short sequences have unmapped
    pages right past their readable length; many random mixed-length decode steps (growing across pages, a
    stale slot reused, slots freed in the middle) match dense attention. Then a read one token past a short
    sequence's readable length is SIGSEGV: the padding really ran up to unmapped memory."""
    script = textwrap.dedent("""
        import random, torch
        from fakes.reference import contiguous_reference
        from kvlab.common.config import make_config
        from kvlab.common.attention.metadata import BatchItem
        from kvlab.common.kv.types import KVShape
        from kvlab.common.sequence import Sequence
        from kvlab.vmm.build import build_vmm
        torch.set_num_threads(1)
        shape, tpp = KVShape(2, 2, 16, 4), 32
        cache = build_vmm(make_config(backend="vmm", page_size=4096, kv_cache_bytes=96 * 4 * 4096,
                                        max_num_seqs=10, max_model_len=8 * tpp, max_num_batched_tokens=512,
                                        check_invariants=True), shape)
        rng, g = random.Random(0), torch.Generator().manual_seed(0)
        def slot_of(seq_id):
            snap = cache.allocator.snapshot()
            return snap["slots"][snap["slot_of"][seq_id]]
        stale = Sequence(99, "99", [0] * (6 * tpp), 8)                   # leaves 6 parked pages in its slot
        cache.allocator.allocate(stale, 6 * tpp)
        cache.allocator.free(stale)
        lengths = [3, 5, 30, 31, 32, 33, 40, 64, 65, 5 * tpp]
        seqs = [Sequence(i, str(i), [0] * n, 64) for i, n in enumerate(lengths)]
        def run(items):
            for it in items:
                cache.allocator.allocate(it.seq, it.context_len)
            meta = cache.storage.prepare(items)
            t = meta.num_tokens
            q = torch.randn(t, 4, 16, generator=g)
            k, v = torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g)
            out = cache.storage.attention(0, q, k, v, meta, 0.25)
            views = cache.storage.views
            ref = contiguous_reference(q, views.k[0], views.v[0], meta.slots, meta.query_lens, meta.context_lens, 0.25)
            err = float((out.double() - ref).abs().max())
            assert err < 1e-5, err
            for it in items:
                it.seq.num_computed_tokens = it.context_len
            return meta
        run([BatchItem(s, 0, s.num_tokens) for s in seqs])
        assert len(slot_of(0)["groups"]) == 6                        # seq 0 took the stale slot
        groups = lengths_seen = 0
        for step in range(40):
            if step == 10:                                               # free slots in the middle
                for s in seqs[2:4]:
                    cache.allocator.free(s)
                seqs = seqs[:2] + seqs[4:]
            live = [s for s in seqs if s.num_tokens < 8 * tpp]
            for s in live:
                s.append_token(1)
            rng.shuffle(live)
            meta = run([BatchItem(s, s.num_tokens - 1, 1) for s in live])
            groups += len(meta.plans["torch_sdpa_contiguous"].decode)
            lengths_seen += len(set(meta.context_lens.tolist()))
            pages_end = (meta.context_lens.long() + tpp - 1) // tpp * tpp  # not the stale slot's parked pages
            assert torch.equal(meta.readable_lens, pages_end), (meta.readable_lens, meta.context_lens)
        print("batches ok", groups, lengths_seen, flush=True)
        short = seqs[1]
        slot = slot_of(short.seq_id)
        readable = -(-short.num_tokens // tpp) * tpp
        assert len(slot["groups"]) * tpp == readable, (len(slot["groups"]), readable)
        print(float(cache.storage.views.k[0][slot["index"], readable].sum()), flush=True)   # first unmapped token
        print("survived", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          check=False, env=env)
    assert "batches ok" in proc.stdout, (proc.returncode, proc.stderr[-3000:])
    groups, lengths = map(int, proc.stdout.split("batches ok")[1].split()[:2])
    assert groups < lengths / 2                                   # far fewer calls than distinct lengths
    assert "survived" not in proc.stdout and proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])
