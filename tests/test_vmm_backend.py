"""The vmm cache on real host virtual memory: growth, stale slots, reclamation, copy-on-write, swap, background
mapping, the contiguous kernel, and the engine end to end."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fakes.batches import contiguous_case
from fakes.reference import contiguous_reference

from kvlab.common.attention.contiguous import contiguous_attention_sdpa
from kvlab.common.attention.metadata import BatchItem
from kvlab.common.config import EngineConfig, make_config
from kvlab.common.errors import ConfigError, DriverError, OutOfKVCache, RequestError
from kvlab.common.kv.seam import KVCache
from kvlab.common.kv.types import CopyKV, DropSavedKV, KVShape, RestoreKV, SaveKV
from kvlab.common.sequence import Sequence
from kvlab.vmm.build import build_vmm
from kvlab.vmm.drivers.accounting import AccountingVirtualMemory
from kvlab.vmm.drivers.host import HostMemory, HostVirtualMemory
from kvlab.vmm.storage import KVViews, VMMStorage

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4096
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4)   # 128 B per token per layer
TPP = PAGE // SHAPE.bytes_per_token_per_layer                                 # 32 tokens per page
TENSORS = 2 * SHAPE.num_layers


def config(groups: int = 16, **overrides) -> EngineConfig:
    values = {"backend": "vmm", "page_size": PAGE, "kv_cache_bytes": groups * TENSORS * PAGE, "max_num_seqs": 4,
              "max_model_len": 4 * TPP, "max_num_batched_tokens": 256, "check_invariants": True}
    return make_config(**(values | overrides))


@pytest.fixture
def make_cache():
    caches = []

    def make(groups: int = 16, shape: KVShape = SHAPE, accounting_only: bool = False, **overrides) -> KVCache:
        extra = {k: overrides.pop(k) for k in ("single_range", "driver") if k in overrides}
        cache = build_vmm(config(groups, **overrides), shape, accounting_only=accounting_only, **extra)
        caches.append(cache)
        return cache
    yield make
    for cache in caches:
        if not cache.closed:
            cache.check_invariants()
            cache.close()


def slots(cache: KVCache) -> list[SimpleNamespace]:
    """Each slot as the allocator's snapshot shows it (index, seq_id, held, groups)."""
    return [SimpleNamespace(**s) for s in cache.allocator.snapshot()["slots"]]


def seq(i: int, n: int) -> Sequence:
    return Sequence(i, str(i), list(range(n)), max_tokens=64)


def step(cache: KVCache, items: list[BatchItem], layer: int = 0, seed: int = 0, shape: KVShape = SHAPE):
    """allocate + prepare + attention on one layer with random q/k/v; returns (meta, q, k, v, out)."""
    for it in items:
        cache.allocator.allocate(it.seq, it.context_len)
    meta = cache.storage.prepare(items)
    g = torch.Generator().manual_seed(seed)
    t = meta.num_tokens
    q = torch.randn(t, shape.num_q_heads, shape.head_dim, generator=g)
    k = torch.randn(t, shape.num_kv_heads, shape.head_dim, generator=g)
    v = torch.randn(t, shape.num_kv_heads, shape.head_dim, generator=g)
    out = cache.storage.attention(layer, q, k, v, meta, 0.25)
    for it in items:
        it.seq.num_computed_tokens = it.context_len
    return meta, q, k, v, out


def reference(cache: KVCache, meta, q, layer: int = 0) -> torch.Tensor:
    views = cache.storage.views
    return contiguous_reference(q, views.k[layer], views.v[layer], meta.slots, meta.query_lens,
                                meta.context_lens, 0.25).float()


def pool_page(cache: KVCache, tensor: int, slot: int, page: int) -> bytes:
    """The bytes of a slot's page read straight from the memfd (not through any mapping)."""
    group = slots(cache)[slot].groups[page]
    driver = cache.allocator.driver
    return os.pread(driver.os.fd, PAGE, driver.os.page_offset(tensor * cache.allocator.geo.num_groups + group))


def as_tokens(raw: bytes, shape: KVShape = SHAPE) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(-1, shape.num_kv_heads, shape.head_dim)


# -- memory really is where the cache says ----------------------------------------------------------------------
def test_kv_written_by_attention_is_in_the_memfd_pages(make_cache):
    cache = make_cache()
    s = seq(0, 40)
    meta, q, k, v, out = step(cache, [BatchItem(s, 0, 40)], layer=1)
    slot = int(meta.slots[0])
    assert len(slots(cache)[slot].groups) == 2
    k_tensor, v_tensor = 1, SHAPE.num_layers + 1                      # K_1 and V_1
    assert torch.equal(as_tokens(pool_page(cache, k_tensor, slot, 0)), k[:TPP])
    assert torch.equal(as_tokens(pool_page(cache, k_tensor, slot, 1))[:40 - TPP], k[TPP:])
    assert torch.equal(as_tokens(pool_page(cache, v_tensor, slot, 1))[:40 - TPP], v[TPP:])
    torch.testing.assert_close(out, reference(cache, meta, q, layer=1), rtol=1e-5, atol=1e-5)


def test_garbage_in_fresh_pages_never_reaches_the_output(make_cache):
    """Fresh device pages are not zeroed (cuMemCreate): with every pool page full of NaN before the first write,
    prefill and padded decode groups still match a reference that reads only the written tokens."""
    cache = make_cache()
    driver = cache.allocator.driver
    os.pwrite(driver.os.fd, b"\xff" * (driver.stats.store_pages * PAGE), 0)   # 0xffffffff: a float32 NaN
    a, b, c, d = seq(0, 40), seq(1, 5), seq(2, 33), seq(3, 20)
    meta, q, *_, out = step(cache, [BatchItem(a, 0, 40), BatchItem(b, 0, 5), BatchItem(c, 0, 33),
                                    BatchItem(d, 0, 20)])
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)
    for s in (a, b, c, d):
        s.append_token(1)
    meta, q, *_, out = step(cache, [BatchItem(s, s.num_tokens - 1, 1) for s in (a, b, c, d)], seed=1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)


def test_pages_map_exactly_when_a_sequence_crosses_a_page_boundary(make_cache):
    cache = make_cache()
    s = seq(0, 1)
    calls = []
    for n in range(1, 4 * TPP + 1):
        cache.allocator.allocate(s, n)
        s.num_computed_tokens = n
        calls.append(cache.stats().extra["pages_mapped"])
        assert len(slots(cache)[0].groups) == -(-n // TPP)
    grew = [n + 1 for n in range(1, len(calls)) if calls[n] != calls[n - 1]]
    assert grew == [TPP + 1, 2 * TPP + 1, 3 * TPP + 1]
    assert calls[-1] == 4 * TENSORS
    # consecutive pool pages merge: per tensor one VMA for the row plus one for the unmapped rest of the range
    assert cache.stats().num_mappings == 2 * TENSORS
    assert cache.allocator.allocate(s, 4 * TPP + 1) is None   # no room: refused, nothing changed
    assert cache.allocator.allocate(s, 4 * TPP + 1) is None


def test_attention_matches_the_reference_for_mixed_batches(make_cache):
    cache = make_cache()
    a, b, c, d = seq(0, 70), seq(1, 5), seq(2, 33), seq(3, 33)
    step(cache, [BatchItem(a, 0, 40), BatchItem(b, 0, 5)])           # prefill (a chunked)
    meta, q, *_, out = step(cache, [BatchItem(a, 40, 30), BatchItem(c, 0, 33), BatchItem(d, 0, 33)], seed=1)
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)
    for s in (a, b, c, d):
        s.append_token(1)
    items = [BatchItem(s, s.num_tokens - 1, 1) for s in (a, b, c, d)]
    meta, q, *_, out = step(cache, items, seed=2)                   # decode: lengths 71, 6, 34, 34
    assert meta.phase == "decode"
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)
    assert cache.kernel_report()["kernels"]["decode"] == "torch_sdpa_contiguous"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_contiguous_kernel_on_random_batches(dtype):
    case = contiguous_case([1, 1, 1, 7, 1, 1], [9, 30, 9, 20, 9, 1], dtype=dtype, spare_slots=3)
    out = contiguous_attention_sdpa(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), case.expected, rtol=tol, atol=tol)


def test_token_straddling_pages_uses_a_page_aligned_row_stride(make_cache):
    shape = KVShape(num_layers=1, num_kv_heads=3, head_dim=64, num_q_heads=9)   # 768 B: 5 tokens per page
    cache = make_cache(shape=shape, kv_cache_bytes=32 * 2 * PAGE, max_model_len=23)
    assert cache.allocator.tokens_per_unit == 5 and cache.allocator.geo.max_len == 25
    assert cache.storage.views.k[0].stride(0) * 4 == 5 * PAGE
    s = seq(0, 23)
    meta, q, *_, out = step(cache, [BatchItem(s, 0, 23)], shape=shape)
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)


def test_geometry_errors_are_config_errors():
    with pytest.raises(ConfigError, match="smaller than one token"):
        build_vmm(config(page_size=4096), KVShape(1, 16, 128, 16))
    with pytest.raises(ConfigError, match="holds no page group"):
        build_vmm(config(kv_cache_bytes=PAGE), SHAPE)


# -- slots, stale pages, reclamation ------------------------------------------------------------------------------
def test_a_free_slot_keeps_its_pages_for_the_next_request(make_cache):
    cache = make_cache()
    a = seq(0, 3 * TPP)
    step(cache, [BatchItem(a, 0, 3 * TPP)])
    mapped = cache.stats().mapped_bytes
    cache.allocator.free(a)
    st = cache.stats()
    assert st.mapped_bytes == mapped and st.unmap_calls == 0           # deferred: nothing unmapped
    assert st.used_units == 0 and st.free_units == 16 and st.extra["reclaimable_units"] == 3
    maps = st.map_calls
    b = seq(1, 40)
    meta, q, *_, out = step(cache, [BatchItem(b, 0, 40)], seed=5)
    assert int(meta.slots[0]) == 0 and cache.stats().map_calls == maps  # reused a's slot, no new mapping
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)
    assert cache.stats().extra["reclaimable_units"] == 1             # the page b does not need yet


def test_slot_choice_prefers_the_stale_slot_that_covers_the_request(make_cache):
    cache = make_cache(max_num_seqs=3)
    seqs = [seq(i, n) for i, n in enumerate((TPP, 3 * TPP, 2 * TPP))]
    for s in seqs:
        step(cache, [BatchItem(s, 0, s.num_tokens)])
    for s in seqs:
        cache.allocator.free(s)
    big = seq(9, 2 * TPP + 3)                                        # needs 3 pages: slot 1 has exactly 3
    cache.allocator.allocate(big, big.num_tokens)
    assert cache.allocator.snapshot()["slot_of"][9] == 1
    small = seq(10, TPP)                                             # needs 1: slot 0 has exactly 1
    cache.allocator.allocate(small, TPP)
    assert cache.allocator.snapshot()["slot_of"][10] == 0


def test_reclamation_under_pressure(make_cache):
    cache = make_cache(groups=6)
    a, b = seq(0, 4 * TPP), seq(1, 4 * TPP)
    step(cache, [BatchItem(a, 0, 4 * TPP)])
    cache.allocator.free(a)                                                    # 4 stale pages in slot 0
    cache.allocator.allocate(seq(5, TPP), TPP)                       # takes slot 0 (covering), 3 pages left over
    assert cache.allocator.num_free_units() == 5
    meta, q, *_, out = step(cache, [BatchItem(b, 0, 4 * TPP)], seed=3)   # 2 from the pool + 2 reclaimed
    st = cache.stats()
    assert st.extra["reclaimed_units"] == 2 and st.unmap_calls == TENSORS   # one tail unmap per tensor
    assert st.free_units == 1 and st.used_units == 5
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)
    c = seq(2, 2 * TPP)
    assert cache.allocator.allocate(c, 2 * TPP) is None
    assert cache.allocator.allocate(c, 2 * TPP) is None   # no room: refused, nothing changed
    assert not cache.allocator.holds(c)                                        # a refused request claims no slot


def test_no_free_slot_means_no_admission(make_cache):
    cache = make_cache(max_num_seqs=2)
    for i in range(2):
        cache.allocator.allocate(seq(i, 1), 1)
    late = seq(2, 1)
    assert cache.allocator.num_free_units() > 1 and cache.allocator.allocate(late, 1) is None
    assert cache.allocator.allocate(late, 1) is None   # no room: refused, nothing changed


def test_a_failed_mapping_leaves_the_books_balanced(make_cache):
    class FailingHost(HostMemory):
        fail_at: int | None = None

        def map(self, addr, first_page, num_pages):
            if self.fail_at is not None:
                self.fail_at -= 1
                if self.fail_at < 0:
                    self.fail_at = None
                    raise DriverError("mmap (map store pages) failed: injected")
            return super().map(addr, first_page, num_pages)
    driver = HostVirtualMemory(memory=FailingHost(PAGE))
    cache = make_cache(driver=driver)
    s = seq(0, 50)
    driver.os.fail_at = 2                                               # the 3rd of 4 tensors fails
    with pytest.raises(DriverError, match="injected"):
        cache.allocator.allocate(s, 50)
    cache.check_invariants()
    assert cache.allocator.num_free_units() == 16 and driver.stats.mapped_pages == 0 and not cache.allocator.holds(s)
    step(cache, [BatchItem(s, 0, 50)])                               # and it works afterwards


# -- fork and copy-on-write ---------------------------------------------------------------------------------------
def test_the_allocator_moves_data_only_by_orders_to_the_storage(make_cache):
    """Copy-on-write and swap reach the K/V only as orders (common/kv/types.py) the storage carries out, in the
    allocator's own addresses: (slot, page) for a copy, (slot, first token) for a save or restore."""
    cache = make_cache()
    orders = []
    carry_out = cache.storage.move
    cache.allocator.emit = lambda order: (orders.append(order), carry_out(order))
    assert not any(isinstance(v, (KVViews, VMMStorage)) for v in vars(cache.allocator).values())
    parent, child = seq(0, 40), seq(1, 40)
    step(cache, [BatchItem(parent, 0, 40)])
    child.num_computed_tokens = 40
    cache.allocator.fork(parent, child)
    child.append_token(7)
    step(cache, [BatchItem(child, 40, 1)])
    c = cache.allocator.snapshot()["slot_of"][1]
    assert orders == [CopyKV((0, 1), (c, 1), TPP)]                            # the shared page the write touches
    cache.allocator.swap_out(child)
    assert orders[1:] == [SaveKV(1, (c, 0), 41)] and set(cache.storage.saved) == {1}   # its computed tokens
    assert cache.allocator.swap_in(child)
    assert orders[2:] == [RestoreKV(1, (cache.allocator.snapshot()["slot_of"][1], 0), 41)] and not cache.storage.saved
    cache.allocator.swap_out(child)
    cache.allocator.free(child)
    assert orders[-1] == DropSavedKV(1) and not cache.storage.saved


def test_fork_shares_pages_and_copies_a_shared_page_on_write(make_cache):
    cache = make_cache()
    parent = seq(0, 40)
    step(cache, [BatchItem(parent, 0, 40)])
    before = cache.stats()
    child = seq(1, 40)
    child.num_computed_tokens = 40
    cache.allocator.fork(parent, child)
    p, c = slots(cache)[0], slots(cache)[cache.allocator.snapshot()["slot_of"][1]]
    assert c.groups == p.groups and cache.allocator.num_free_units() == before.free_units   # shared, nothing new
    assert cache.stats().mapped_bytes == before.mapped_bytes
    k_parent = cache.storage.views.k[0][0, :40].clone()
    assert torch.equal(cache.storage.views.k[0][c.index, :40], k_parent)   # the child sees the parent's KV

    child.append_token(7)
    assert cache.allocator.units_needed(child, 41) == 1                         # page 1 is shared and will be written
    meta, q, k, _, out = step(cache, [BatchItem(child, 40, 1)], seed=9)
    assert cache.stats().cow_copies == 1
    p, c = slots(cache)[p.index], slots(cache)[c.index]
    assert c.groups[0] == p.groups[0] and c.groups[1] != p.groups[1]
    assert torch.equal(cache.storage.views.k[0][c.index, :40], k_parent)   # copied before the write
    assert torch.equal(cache.storage.views.k[0][c.index, 40], k[0])
    assert torch.equal(cache.storage.views.k[0][0, :40], k_parent)         # the parent is unchanged
    assert not torch.equal(cache.storage.views.k[0][0, 40], k[0])
    torch.testing.assert_close(out, reference(cache, meta, q), rtol=1e-5, atol=1e-5)
    child_page = as_tokens(pool_page(cache, 0, c.index, 1))
    assert torch.equal(child_page[40 - TPP], k[0])                   # the copy is a different pool page
    assert not torch.equal(as_tokens(pool_page(cache, 0, 0, 1))[40 - TPP], k[0])

    parent.append_token(8)
    assert cache.allocator.units_needed(parent, 41) == 0                        # page 1 is the parent's alone now
    step(cache, [BatchItem(parent, 40, 1)])
    assert cache.stats().cow_copies == 1
    cache.allocator.free(child)
    c = slots(cache)[c.index]
    assert cache.allocator.snapshot()["refs"][p.groups[0]] == 1 and c.groups == []   # a free slot keeps no shared page


@pytest.mark.parametrize(("merges", "background_mapping"), [(True, False), (False, False), (True, True)])
def test_a_growth_takes_a_freed_slots_parked_pages_whole_where_one_call_unmaps_a_run(make_cache, merges,
                                                                                     background_mapping):
    """Host mmap unmaps a run in one call, so a freed slot's tail goes whole and later growths only map. CUDA
    unmaps page by page, and the background mapper runs the unmaps off the step: there only the page needed goes
    and the rest stay parked for a later owner (whose maps they save)."""
    whole = merges and not background_mapping
    cache = make_cache(groups=4, max_model_len=4 * TPP, accounting_only=True, background_mapping=background_mapping,
                       driver=AccountingVirtualMemory(PAGE, merges=merges))
    a, b = seq(0, 3 * TPP), seq(1, TPP)
    cache.allocator.allocate(a, 3 * TPP)
    cache.allocator.allocate(b, TPP)
    cache.allocator.free(a)                      # three pages parked in a's freed slot
    cache.allocator.allocate(b, TPP + 1)         # b needs one more: no group is free
    parked = [len(s.groups) for s in slots(cache) if s.seq_id is None and s.groups]
    unmap_calls = cache.stats().unmap_calls
    assert (parked, cache.allocator.free_pages.num_free) == (([], 2) if whole else ([2], 0))
    if background_mapping:                       # the unmap was put off: the mapper's next job runs it
        return
    assert unmap_calls == SHAPE.num_layers * 2   # one unmap per tensor either way (a run of 3, or one page)
    cache.allocator.allocate(b, 2 * TPP + 1)     # the next page: free already (whole), or one more unmap
    assert cache.stats().unmap_calls == unmap_calls * (1 if whole else 2)


def test_a_copy_on_write_never_takes_a_page_under_the_tokens_the_slot_holds(make_cache):
    """A fork child holds what its parent allocated (40 tokens, two pages), more than it has computed (4). Writing
    token 4 copies the shared page 0; the only unit to copy into is an idle cached page. Reclaiming took the
    child's own page 1 first, as if 5 tokens were all it held: the slot kept 40 tokens on one page (issue 39's
    slow property run found it)."""
    cache = make_cache(groups=4, enable_prefix_caching=True)
    alloc = cache.allocator
    cached = seq(0, TPP)
    alloc.allocate(cached, TPP)
    cached.num_computed_tokens = TPP
    alloc.free(cached)                                     # its page stays cached, idle: evictable
    parent = Sequence(1, "1", [1000 + i for i in range(40)], max_tokens=64)
    alloc.allocate(parent, 40)
    parent.num_computed_tokens = 4
    child = Sequence(2, "2", list(parent.token_ids), max_tokens=64)
    child.num_computed_tokens = 4
    alloc.fork(parent, child)
    alloc.allocate(Sequence(3, "3", [2000 + i for i in range(TPP)], max_tokens=64), TPP)   # the last free group
    assert alloc.num_free_units() == 1 and alloc.units_needed(child, 5) == 1
    assert alloc.allocate(child, 5) == 0
    c = slots(cache)[alloc.snapshot()["slot_of"][2]]
    assert c.held == 40 and len(c.groups) == 2 and cache.stats().cow_copies == 1
    cache.check_invariants()


def test_fork_needs_a_slot_and_a_parent(make_cache):
    cache = make_cache(max_num_seqs=2)
    a, b = seq(0, 10), seq(1, 10)
    with pytest.raises(RequestError, match="holds no vmm slot"):
        cache.allocator.fork(a, b)
    cache.allocator.allocate(a, 10)
    cache.allocator.allocate(b, 10)
    with pytest.raises(OutOfKVCache, match="no free vmm slot"):
        cache.allocator.fork(a, seq(2, 10))


# -- swap -------------------------------------------------------------------------------------------------------
def test_swap_round_trip(make_cache):
    cache = make_cache(max_num_seqs=1)
    s = seq(0, 45)
    step(cache, [BatchItem(s, 0, 45)])
    saved = [c[0, :45].clone() for c in cache.storage.views.k + cache.storage.views.v]
    cache.allocator.swap_out(s)
    assert not cache.allocator.holds(s) and cache.allocator.num_free_units() == 16
    assert cache.stats().swapped_out_bytes == 45 * SHAPE.bytes_per_token
    other = seq(1, 60)
    step(cache, [BatchItem(other, 0, 60)], seed=4)                   # overwrite the same slot's pages
    assert cache.allocator.swap_in(s) is False   # no room: refused, nothing changed
    assert cache.allocator.swap_in(s) is False
    cache.allocator.free(other)
    assert cache.allocator.swap_in(s) is True
    assert cache.allocator.holds(s) and cache.stats().swapped_in_bytes == 45 * SHAPE.bytes_per_token
    for c, data in zip(cache.storage.views.k + cache.storage.views.v, saved):
        assert torch.equal(c[0, :45], data)
    with pytest.raises(RequestError, match="not swapped out"):
        cache.allocator.swap_in(s)


# -- background mapping ---------------------------------------------------------------------------------------
def test_background_mapping_under_concurrent_growth(make_cache):
    cache = make_cache(groups=32, background_mapping=True, max_model_len=8 * TPP)
    seqs = [seq(i, 3 + 5 * i) for i in range(4)]
    step(cache, [BatchItem(s, 0, s.num_tokens) for s in seqs])
    outs = []
    for n in range(5 * TPP):
        for s in seqs:
            s.append_token(n)
        meta, q, *_, out = step(cache, [BatchItem(s, s.num_tokens - 1, 1) for s in seqs], seed=n)
        if n % 40 == 0:
            outs.append((out, reference(cache, meta, q)))
    st = cache.stats()
    assert st.extra["lookahead_pages"] > 0                            # the worker mapped pages ahead of need
    assert st.extra["background_seconds"] > 0
    for out, ref in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    threads = [t.name for t in threading.enumerate()]
    assert any(name.startswith("kvlab-vmm-mapper") for name in threads)


def test_map_ahead_jobs_start_when_the_step_reads_its_rows_not_while_it_is_scheduled(make_cache):
    """The scheduler's allocate calls never wait for the worker: a step's jobs start together when the storage reads
    the rows (right before the forward pass), and the slot's next allocate waits for its own job only."""
    cache = make_cache(groups=8, background_mapping=True, max_model_len=4 * TPP)
    a, b = seq(0, TPP - 1), seq(1, TPP - 1)
    for s in (a, b):
        cache.allocator.allocate(s, TPP - 1)                  # near a boundary: asks for the next page
    mapper = cache.allocator.mapper
    assert sorted(mapper.wanted) == [0, 1] and not mapper.pending   # asked for, not started
    assert cache.stats().extra["lookahead_pages"] == 0
    cache.allocator.rows([], check=False)                     # the step's rows: both jobs start, as one
    assert not mapper.wanted and len(set(mapper.pending.values())) == 1
    a.num_computed_tokens = TPP - 1
    cache.allocator.allocate(a, TPP + 1)                      # waits for its job: the page is already there
    assert cache.stats().extra["lookahead_pages"] == 2
    assert [len(s.groups) for s in slots(cache)[:2]] == [2, 2]
    cache.check_invariants()


def test_a_background_mapping_error_reaches_the_caller(make_cache):
    class WorkerFails(HostMemory):
        def map(self, addr, first_page, num_pages):
            if threading.current_thread().name.startswith("kvlab-vmm-mapper"):
                raise DriverError("mmap (map store pages) failed: injected in the worker")
            return super().map(addr, first_page, num_pages)
    cache = make_cache(driver=HostVirtualMemory(memory=WorkerFails(PAGE)), background_mapping=True)
    s = seq(0, TPP - 1)
    cache.allocator.allocate(s, TPP - 1)                                       # close to a boundary: maps ahead
    s.num_computed_tokens = TPP - 1
    with pytest.raises(DriverError, match="injected in the worker"):
        cache.allocator.allocate(s, TPP)
    cache.check_invariants()
    assert len(slots(cache)[0].groups) == 1
    cache.allocator.allocate(s, TPP + 1)                                       # the caller maps it itself


@pytest.mark.parametrize("single_range", [False, True])
def test_accounting_mode_keeps_the_same_books(make_cache, single_range):
    """Same calls, same decisions: the simulator's cache agrees with the real one on every count."""
    real = make_cache(groups=8, single_range=single_range)
    acct = make_cache(groups=8, accounting_only=True, single_range=single_range)
    script = [("alloc", 0, 50), ("alloc", 1, 90), ("alloc", 0, 70), ("free", 1, 0), ("alloc", 2, 30),
              ("fork", 0, 3), ("alloc", 3, 75), ("swap_out", 2, 0), ("alloc", 4, 120), ("free", 0, 0)]
    for cache in (real, acct):
        seqs: dict[int, Sequence] = {}
        for op, i, n in script:
            s = seqs.setdefault(i, seq(i, max(n, 1)))
            if op == "alloc":
                cache.allocator.allocate(s, n)
                if i != 3:
                    s.num_computed_tokens = n
            elif op == "fork":
                child = seqs.setdefault(n, seq(n, 70))
                child.num_computed_tokens = s.num_computed_tokens
                cache.allocator.fork(s, child)
            else:
                getattr(cache.allocator, op)(s)
            cache.check_invariants()
    r, a = real.stats(), acct.stats()
    for name in ("used_units", "free_units", "mapped_bytes", "num_mappings", "map_calls", "unmap_calls",
                 "cow_copies", "swapped_out_bytes", "live_tokens"):
        assert getattr(r, name) == getattr(a, name), name
    assert r.extra["pages_mapped"] == a.extra["pages_mapped"] and r.extra["stale_slots"] == a.extra["stale_slots"]
    assert r.cow_copies == 1 and r.unmap_calls > 0


def test_accounting_mode_books_a_page_group_once_not_per_tensor(make_cache):
    """The simulator's driver keeps one table for all 2L tensors; the per-tensor tables are written only when
    someone reads them (here: never, until the end)."""
    cache = make_cache(groups=8, accounting_only=True, check_invariants=False)
    for i in range(3):
        cache.allocator.allocate(seq(i, 50), 50)
    cache.allocator.free(seq(0, 50))
    cache.allocator.allocate(seq(3, 120), 120)                                  # reclaims the stale slot's pages
    regions = [region for region, _ in cache.allocator.ranges.places]
    assert cache.allocator.ranges.mirror.books is not None and all(not r.pages for r in regions)
    assert cache.stats().mapped_bytes == 8 * TENSORS * PAGE              # every count is kept all the same
    assert sum(len(r.mapped) for r in regions) == 8 * TENSORS            # read: written out now
    cache.check_invariants()


def test_best_fit_claim_is_the_scan_rule():
    """Free slots bucketed by parked pages give the same choice as scanning every free slot."""
    import random

    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.slots import SlotTable
    rng = random.Random(3)
    table = SlotTable(Geometry(PAGE, TPP, pages_per_slot=8, num_slots=40, num_tensors=2, num_groups=400))
    next_group = 0
    for step in range(600):
        free = [s for s in table.slots if s.seq_id is None]
        live = [s for s in table.slots if s.seq_id is not None]
        if free and (not live or rng.random() < 0.5):
            tokens = rng.randint(0, 8 * TPP)
            need, fewest = -(-tokens // TPP), rng.random() < 0.2
            expect = min(free, key=lambda s: (len(s.groups), s.index)) if fewest else \
                min(free, key=lambda s: (len(s.groups) < need, abs(len(s.groups) - need), s.index))
            slot = table.claim(step, tokens, fewest_pages=fewest)
            assert slot is expect, step
            with table.accounting(slot):                               # the owner grows to its pages
                grow = rng.randint(0, 8 - len(slot.groups))
                slot.groups.extend(range(next_group, next_group + grow))
                next_group += grow
            table.hold(slot, rng.randint(0, len(slot.groups) * TPP))
        else:
            slot = rng.choice(live)
            table.vacate(slot)
            with table.accounting(slot):                               # reclaimed down to some pages
                del slot.groups[rng.randint(0, len(slot.groups)):]
        table.check(lambda g: False)


def test_single_range_comes_from_the_config(make_cache):
    assert len(make_cache(vmm_single_range=True).allocator.driver.regions) == 1
    assert len(make_cache(vmm_single_range=True, single_range=False).allocator.driver.regions) == TENSORS


def test_single_range_layout(make_cache):
    cache = make_cache(single_range=True)
    assert len(cache.allocator.driver.regions) == 1
    s = seq(0, 70)
    meta, q, *_, out = step(cache, [BatchItem(s, 0, 70)], layer=1)
    torch.testing.assert_close(out, reference(cache, meta, q, layer=1), rtol=1e-5, atol=1e-5)


# -- safety --------------------------------------------------------------------------------------------------------
def test_prepare_refuses_unallocated_positions(make_cache):
    cache = make_cache()
    s = seq(0, 40)
    cache.allocator.allocate(s, 20)
    with pytest.raises(RequestError, match="allocate"):
        cache.storage.prepare([BatchItem(s, 0, 40)])
    with pytest.raises(RequestError, match="holds no vmm slot"):
        cache.storage.prepare([BatchItem(seq(1, 3), 0, 3)])


def test_close_completes_while_a_caller_holds_a_view(make_cache):
    cache = make_cache()
    cache.allocator.allocate(seq(0, 10), 10)
    row = cache.storage.views.k[0][0]
    cache.close()                                    # never refused: the viewed ranges wait for the view
    driver = cache.allocator.driver
    assert driver.closed and driver.stats.deferred_releases >= 1
    row[:10].fill_(1.0)                              # the view still reads mapped memory
    del row
    gc.collect()
    assert not driver.regions and driver.stats.num_mappings == 0
    cache.close()


def test_prepare_promises_reads_up_to_the_last_page_the_held_tokens_need(make_cache):
    cache = make_cache()
    a = seq(0, 3 * TPP)
    step(cache, [BatchItem(a, 0, 3 * TPP)])
    cache.allocator.free(a)                                                    # slot 0 keeps 3 parked pages
    b, c, d = seq(1, 5), seq(2, TPP + 1), seq(3, 10)
    cache.allocator.allocate(b, 5)                                             # b takes the stale slot
    cache.allocator.allocate(d, 2 * TPP + 1)                                   # held past this step's context
    meta, *_ = step(cache, [BatchItem(b, 0, 5), BatchItem(c, 0, TPP + 1), BatchItem(d, 0, 10)])
    assert int(meta.slots[0]) == 0 and len(slots(cache)[0].groups) == 3
    # b's parked pages are reclaimable by any allocate, so they are not promised; d's held pages are
    assert meta.readable_lens.tolist() == [TPP, 2 * TPP, 3 * TPP]
    assert meta.readable_lens.dtype == torch.int64


def test_the_kernel_never_reads_past_a_readable_length_and_unmapped_pages_fault():
    """In a subprocess: a decode batch mixing a long and a short sequence whose later pages are unmapped runs
    fine (the short ones are read up to their readable length, one page); then a deliberate read of the short
    one's unmapped page is SIGSEGV. tests/test_vmm_kernels.py runs many such batches."""
    script = textwrap.dedent(f"""
        import torch
        from kvlab.common.config import make_config
        from kvlab.common.attention.metadata import BatchItem
        from kvlab.common.kv.seam import KVCache
        from kvlab.common.kv.types import KVShape
        from kvlab.common.sequence import Sequence
        from kvlab.vmm.build import build_vmm
        shape = KVShape(2, 2, 16, 4)
        cache = build_vmm(make_config(backend="vmm", page_size={PAGE}, kv_cache_bytes=64 * 4 * {PAGE},
                                        max_num_seqs=4, max_model_len=8 * {TPP}), shape)
        long, short, same = (Sequence(i, str(i), [0] * n, 4) for i, n in enumerate((5 * {TPP}, 3, 3)))
        items = [BatchItem(long, 0, long.num_tokens), BatchItem(short, 0, 3), BatchItem(same, 0, 3)]
        for it in items:
            cache.allocator.allocate(it.seq, it.context_len)
        meta = cache.storage.prepare(items)
        t = meta.num_tokens
        cache.storage.attention(0, torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16), meta, 0.25)
        for s in (long, short, same):
            s.num_computed_tokens = s.num_tokens
            s.append_token(1)
            cache.allocator.allocate(s, s.num_tokens)
        items = [BatchItem(s, s.num_tokens - 1, 1) for s in (long, short, same)]
        meta = cache.storage.prepare(items)
        q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
        out = cache.storage.attention(0, q, k, v, meta, 0.25)
        print("decode ok", bool(torch.isfinite(out).all()), flush=True)
        print(float(cache.storage.views.k[0][1, 2 * {TPP}].sum()), flush=True)    # short's third page: never mapped
        print("survived", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          check=False)
    assert "decode ok True" in proc.stdout, proc.stderr[-2000:]
    assert "survived" not in proc.stdout and proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])


def test_stats_report_the_mapping_work(make_cache):
    cache = make_cache()
    step(cache, [BatchItem(seq(0, 70), 0, 70)])
    st = cache.stats()
    assert st.backend == "vmm" and st.unit_name == "page" and st.tokens_per_unit == TPP
    assert st.mapped_bytes == 3 * TENSORS * PAGE and st.extra["pages"] == 3 * TENSORS
    assert st.num_mappings == 2 * TENSORS and st.map_calls == TENSORS and st.map_seconds > 0
    assert st.reserved_bytes == TENSORS * 4 * cache.allocator.geo.row_bytes and st.allocator_seconds > 0
    assert st.live_tokens == 70 and st.used_units == 3


def test_prefix_caching_is_supported(make_cache, caplog):
    cache = make_cache(enable_prefix_caching=True)
    assert "not supported" not in caplog.text
    assert cache.allocator.allocate(seq(0, 10), 10) == 0   # cold: nothing cached yet (tests/test_vmm_prefix.py)
    assert cache.stats().extra["prefix_caching"] == "on" and cache.stats().prefix_hit_tokens == 0


def test_engine_greedy_outputs_match_paged():
    from kvlab.common.llm import LLM
    from kvlab.common.sampling_params import SamplingParams
    torch.set_num_threads(1)
    prompts = [[1 + i, 2, 3, 4 + i, 5] * (i + 1) for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    outputs = {}
    for backend in ("paged", "vmm"):
        llm = LLM(model="tiny", backend=backend, max_num_seqs=3, check_invariants=True)
        outputs[backend] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        if backend == "vmm":
            st = llm.cache_stats()
            assert st.map_calls > 0 and st.mapped_bytes > 0 and st.num_mappings > 0
    assert all(len(t) == 20 for t in outputs["vmm"])
    assert outputs["vmm"] == outputs["paged"]


@pytest.mark.parametrize("query_lens,context_lens,calls", [([1, 1, 1, 1], [9, 30, 9, 1], 1),
                                                            ([1, 7, 3], [9, 20, 3], 3)])
def test_flash_attn_adapter_against_the_fake_library(monkeypatch, query_lens, context_lens, calls):
    from fakes import install_fake

    from kvlab.common.attention.flash_attn_contiguous import contiguous_attention_flash_attn
    fake = install_fake(monkeypatch, "flash_attn")
    case = contiguous_case(query_lens, context_lens, dtype=torch.float16)
    out = contiguous_attention_flash_attn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), case.expected, rtol=2e-3, atol=2e-3)
    assert len(fake.calls) == calls                            # decode: the whole batch in one call
    assert all(not kw["paged"] and kw["causal"] for _, kw in fake.calls)


@pytest.mark.parametrize("accounting_only", [True, False])
def test_random_operations_keep_every_invariant(make_cache, accounting_only):
    """Seeded random allocate/grow/fork/free/swap under pressure; the books and the driver agree after each."""
    import random
    rng = random.Random(7)
    cache = make_cache(groups=10, max_num_seqs=5, accounting_only=accounting_only, check_invariants=False)
    live: list[Sequence] = []
    swapped: list[Sequence] = []
    next_id = 0
    for _ in range(300):
        op = rng.choice(["new", "grow", "grow", "fork", "free", "swap_out", "swap_in"])
        try:
            if op == "new":
                s = seq(next_id, rng.randint(1, 3 * TPP))
                next_id += 1
                if cache.allocator.allocate(s, s.num_tokens) is None:
                    raise OutOfKVCache("refused")
                s.num_computed_tokens = s.num_tokens
                live.append(s)
            elif op == "grow" and live:
                s = rng.choice(live)
                n = min(s.num_computed_tokens + rng.randint(1, TPP), cache.allocator.geo.max_len)
                if cache.allocator.allocate(s, n) is None:
                    raise OutOfKVCache("refused")
                s.num_computed_tokens = n
            elif op == "fork" and live:
                parent = rng.choice(live)
                child = seq(next_id, parent.num_computed_tokens)
                next_id += 1
                child.num_computed_tokens = parent.num_computed_tokens
                cache.allocator.fork(parent, child)
                live.append(child)
            elif op == "free" and live:
                cache.allocator.free(live.pop(rng.randrange(len(live))))
            elif op == "swap_out" and live:
                s = live.pop(rng.randrange(len(live)))
                cache.allocator.swap_out(s)
                swapped.append(s)
            elif op == "swap_in" and swapped:
                s = swapped[0]
                if not cache.allocator.swap_in(s):
                    raise OutOfKVCache("refused")
                live.append(swapped.pop(0))
        except OutOfKVCache:
            pass
        cache.check_invariants()
        assert all(cache.allocator.holds(s) for s in live) and not any(cache.allocator.holds(s) for s in swapped)
    st = cache.stats()
    assert st.cow_copies > 0 and st.extra["reclaimed_units"] > 0 and st.swapped_in_bytes > 0


def test_the_background_mapper_takes_parked_pages_of_freed_slots(make_cache):
    cache = make_cache(groups=3, background_mapping=True, max_model_len=3 * TPP)
    a, b = seq(0, TPP + 1), seq(1, TPP - 1)
    cache.allocator.allocate(a, TPP + 1)           # two pages, far from a third: no job of a's own to race b's
    cache.allocator.allocate(b, TPP - 1)           # the last free group; near a boundary, nothing free to map ahead
    cache.allocator.allocate(b, TPP)               # (fences the skipped job)
    cache.allocator.free(a)                        # a's two pages stay parked in its freed slot
    cache.allocator.allocate(b, TPP)               # in place: asks the mapper to map b's next page
    cache.allocator.allocate(b, TPP)               # fences that job
    by_seq = {s.seq_id: s for s in slots(cache)}
    assert len(by_seq[1].groups) == 2              # the mapper unmapped a parked page and mapped it ahead for b
    assert [len(s.groups) for s in slots(cache) if s.seq_id is None and s.groups] == [1]
    assert cache.stats().extra["lookahead_pages"] == 1
