"""Prefix caching on the vmm backend by page aliasing (vmm/prefix.py): exact hit counts on a hand-made trace at
several unit sizes (and paged at block size 16), real aliasing in the memfd pool, eviction under pressure,
the random state machine with prefix admissions, and greedy outputs equal with the cache on and off."""
from __future__ import annotations

import os

import pytest
from helpers.invariants import SHAPE, Workload, check_structure

from kvlab import LLM, SamplingParams
from kvlab.common.config import make_config
from kvlab.common.kv.seam import create_cache
from kvlab.common.sequence import Sequence

TOKEN_BYTES = SHAPE.bytes_per_token_per_layer   # 256: a 4096-byte page holds 16 tokens
S = list(range(1000, 1096))                    # a 96-token shared system prompt


def trace() -> list[tuple[list[int], str]]:
    """(prompt, adapter id): the hits each should get are worked out by hand in EXPECTED."""
    return [
        (S + list(range(10, 20)), ""),            # 106 tokens: cold
        (S + list(range(20, 30)), ""),            # same 96-token system prompt, another tail
        (S[:40] + list(range(30, 60)), ""),       # the first 40 tokens of it only
        (S + list(range(20, 30)), ""),            # the second prompt again, all 106 tokens
        (list(range(60, 110)), ""),               # unrelated
        (S + list(range(10, 20)), "lora-a"),      # the first prompt under another adapter: no hit
    ]


# unit tokens -> hit tokens per request. A hit is whole cached units only, the prompt's last token is always
# computed, and a request caches only the full units of what it computed (106 tokens = 6 x 16, 3 x 32, 1 x 64).
EXPECTED = {16: [0, 96, 32, 96, 0, 0], 32: [0, 96, 32, 96, 0, 0], 64: [0, 64, 0, 64, 0, 0]}


def run_trace(config) -> list[int]:
    kv = create_cache(config, SHAPE, accounting_only=True)
    hits = []
    for sid, (prompt, adapter) in enumerate(trace(), 1):
        seq = Sequence(sid, str(sid), prompt, max_tokens=1, adapter_id=adapter)
        hit = kv.allocator.allocate(seq, len(prompt))
        assert hit is not None
        hits.append(hit)
        seq.num_computed_tokens = len(prompt)
        kv.allocator.allocate(seq, len(prompt))   # the step after: the computed pages are registered
        kv.allocator.free(seq)
    assert kv.stats().prefix_hit_tokens == sum(hits)
    kv.allocator.check_invariants()
    kv.close()
    return hits


@pytest.mark.parametrize("tokens_per_page", [16, 32, 64])
def test_hand_made_trace_gives_the_expected_hits_for_each_page_size(tokens_per_page):
    page = tokens_per_page * TOKEN_BYTES
    config = make_config(backend="vmm", page_size=page, kv_cache_bytes=64 * 2 * SHAPE.num_layers * page,
                         max_model_len=256, max_num_seqs=4, enable_prefix_caching=True)
    assert run_trace(config) == EXPECTED[tokens_per_page]


def test_hand_made_trace_on_paged_block_16_and_without_the_cache():
    paged = make_config(backend="paged", block_size=16, kv_cache_bytes=256 * 16 * SHAPE.bytes_per_token,
                        max_model_len=256, max_num_seqs=4, enable_prefix_caching=True)
    assert run_trace(paged) == EXPECTED[16]
    off = make_config(backend="vmm", page_size=4096, kv_cache_bytes=64 * 4 * 4096, max_model_len=256,
                      max_num_seqs=4)
    assert run_trace(off) == [0] * len(trace())


def _pool_offsets(w: Workload, sid: int) -> list[int]:
    snap, driver = w.cache.snapshot(), w.cache.driver
    groups = snap["slots"][snap["slot_of"][sid]]["groups"]
    return [driver.os.page_offset(g) for g in groups]   # tensor 0 (layer 0's K)


def test_a_hit_maps_the_same_pool_pages_and_a_write_after_copy_on_write_splits_them():
    w = Workload("vmm", accounting_only=False, enable_prefix_caching=True, check_invariants=True)
    prefix = list(range(200, 240))                         # 40 tokens: 2 whole 16-token pages
    w.admit(prefix + [7, 8, 9], max_tokens=4, chunk=64)
    w.admit(prefix + [11, 12], max_tokens=4, chunk=64)
    a, b = w.ids("live")
    assert w.ops["prefix_hit_tokens"] == 32
    check_structure(w.kv, w.tracked, prefix_caching=True)
    off_a, off_b = _pool_offsets(w, a), _pool_offsets(w, b)
    assert off_a[:2] == off_b[:2] and off_a[2] != off_b[2]  # two slots backed by the same pool offsets
    driver, page = w.cache.driver, 4096
    shared = os.pread(driver.os.fd, page, off_a[0])
    assert shared.strip(b"\0"), "the shared page holds the prefix's K"
    # b rewrites its first page: copy-on-write gives it its own pool page first, with the same bytes
    w.seq(b).num_computed_tokens = 0
    assert w.cache.allocate(w.seq(b), 16) == 0
    assert w.cache.stats().cow_copies == 1
    off_b2 = _pool_offsets(w, b)
    assert off_b2[0] != off_a[0] and off_b2[1] == off_a[1]
    assert os.pread(driver.os.fd, page, off_b2[0]) == shared
    os.pwrite(driver.os.fd, b"\x01" * page, off_b2[0])        # the write lands in b's copy only
    assert os.pread(driver.os.fd, page, off_a[0]) == shared
    w.free(a)
    w.free(b)
    w.drain()


def test_cached_pages_idle_after_free_are_reused_then_evicted_whole_under_pressure():
    w = Workload("vmm", accounting_only=True, enable_prefix_caching=True)   # 8 page groups of 16 tokens
    w.admit(list(range(300, 349)), max_tokens=1, chunk=64)                # 49 tokens: 3 full pages cached
    (a,) = w.ids("live")
    w.free(a)
    stats = w.cache.stats()
    assert stats.extra["prefix_idle_pages"] == 3 and stats.free_units == stats.total_units
    w.admit(list(range(300, 340)), max_tokens=1, chunk=64)                # 40 tokens: hits 2 idle pages
    assert w.ops["prefix_hit_tokens"] == 32
    assert w.cache.stats().extra["prefix_idle_pages"] == 1
    w.admit(list(range(500, 563)), max_tokens=1, chunk=63)                # needs 4 pages: 2 free + ... evict
    w.admit(list(range(600, 615)), max_tokens=1, chunk=15)                # 1 page: the last idle one goes
    stats = w.cache.stats()
    assert stats.extra["prefix_evictions"] >= 1 and stats.extra["prefix_idle_pages"] == 0
    assert w.ops["refused"] == 0
    w.cache.check_invariants()
    w.drain()   # check_drained (cached-but-unowned pages included), then close


SMALL = dict(max_model_len=128, page_size=4096, block_size=8, threads=1, max_num_seqs=8)
GROUP = 8 * 4096                # the tiny model's page group: 8 tensors x 4096 B, 8 tokens
SYSTEM = list(range(40, 120))   # 80 tokens: 10 of the tiny model's 8-token pages


def _prompts() -> list[list[int]]:
    return [SYSTEM + [200 + i, 300 + i, 400 + i] * (i + 1) for i in range(6)]


def _greedy(backend: str, prefix: bool, kv_cache_bytes: int) -> tuple[list[list[int]], int, int]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM("tiny", backend=backend, enable_prefix_caching=prefix, kv_cache_bytes=kv_cache_bytes,
             check_invariants=True, **SMALL) as llm:
        first = llm.generate(_prompts()[:1], params)            # warms the cache with the system prompt
        rest = llm.generate(_prompts()[1:], params)
        m, hits = llm.metrics(), llm.cache_stats().prefix_hit_tokens
    return [o.outputs[0].token_ids for o in first + rest], hits, m.preemptions


@pytest.mark.parametrize("backend", ["vmm", "paged"])
@pytest.mark.parametrize("kv_cache_bytes", [2 * 1024 * 1024, 24 * GROUP], ids=["roomy", "preempting"])
def test_greedy_outputs_are_identical_with_the_prefix_cache_on_and_off(backend, kv_cache_bytes):
    off, off_hits, _ = _greedy(backend, False, kv_cache_bytes)
    on, on_hits, preemptions = _greedy(backend, True, kv_cache_bytes)
    assert on == off and all(len(t) == 12 for t in on)
    assert off_hits == 0 and on_hits >= 5 * 72   # every later prompt hits the 80-token system prompt's pages
    if kv_cache_bytes < 1024 * 1024:
        assert preemptions > 0


def test_swap_in_counts_its_own_pages_not_prefix_hits():
    w = Workload("vmm", accounting_only=True, enable_prefix_caching=True)   # 8 page groups of 16 tokens
    prompt = list(range(300, 349))                                        # 49 tokens: 3 full pages cached
    w.admit(prompt, max_tokens=1, chunk=64)
    w.admit(prompt, max_tokens=1, chunk=64)                               # aliases a's 3 pages
    a, b = w.ids("live")
    assert w.ops["prefix_hit_tokens"] == 48
    w.swap_out(a)                                                         # b still maps the cached pages
    assert w.cache.units_needed(w.seq(a), w.seq(a).num_computed_tokens) == 4   # its own 4 pages, no hits
    w.swap_in(a)
    assert w.ids("live") == [a, b]
    w.cache.check_invariants()
    w.drain()
