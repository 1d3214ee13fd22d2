"""The seam's contract, run against every registered backend (the built-in ones and any a test registers):
one-call allocate answers None and changes nothing when there is no room, holds() means resident, fork and
swap keep the stored K/V (read back through the backend's probe), real and accounting modes decide alike,
and close() is idempotent."""
from __future__ import annotations

import pytest
import torch
from helpers.invariants import SHAPE, backend_config, check_drained

from kvlab.common.attention.declarations import kernels_for
from kvlab.common.attention.metadata import BatchItem
from kvlab.common.kv.registry import backend_names, get_backend
from kvlab.common.kv.seam import KVCache, create_cache
from kvlab.common.sequence import Sequence

pytestmark = pytest.mark.parametrize("backend", backend_names())


def build(backend: str, real: bool = False) -> KVCache:
    return create_cache(backend_config(backend), SHAPE, accounting_only=not real)


def seq(i: int, n: int) -> Sequence:
    return Sequence(i, str(i), [3 + (7 * i + j) % 50 for j in range(n)], max_tokens=4)


def write(cache: KVCache, s: Sequence, start: int, n: int, seed: int) -> None:
    """One prefill step of n tokens through the storage (K = V = seeded noise)."""
    meta = cache.storage.prepare([BatchItem(s, start, n)])
    g = torch.Generator().manual_seed(seed)
    for layer in range(SHAPE.num_layers):
        q = torch.randn(n, SHAPE.num_q_heads, SHAPE.head_dim, generator=g)
        kv = torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
        cache.storage.attention(layer, q, kv, kv.clone(), meta, SHAPE.head_dim ** -0.5)
    s.num_computed_tokens = start + n


def fill(cache: KVCache) -> list[Sequence]:
    """Admit 8-token sequences until the allocator says no room."""
    held = []
    while True:
        s = seq(len(held), 8)
        if cache.allocator.allocate(s, 8) is None:
            return held
        held.append(s)


def test_the_spec_is_complete(backend):
    spec = get_backend(backend)
    assert spec.name == backend and spec.layout in ("paged", "contiguous") and kernels_for(spec.layout)
    assert spec.label(spec.default_options())
    assert set(spec.load_probe().test_options) <= {"kv_cache_bytes", *spec.options.__dataclass_fields__}


def test_no_room_is_none_and_changes_nothing(backend):
    cache = build(backend)
    books = cache.allocator
    held = fill(cache)
    assert held, "the test cache holds no 8-token sequence at all"
    free, before = books.num_free_units(), books.snapshot()
    extra = seq(999, 8)
    assert books.allocate(extra, 8) is None
    assert books.num_free_units() == free and books.snapshot() == before and not books.holds(extra)
    for s in held:
        books.free(s)
    check_drained(cache)
    cache.close()


def test_holds_means_resident(backend):
    cache = build(backend)
    books, s = cache.allocator, seq(0, 8)
    assert not books.holds(s)
    assert books.allocate(s, 8) == 0 and books.holds(s)
    s.num_computed_tokens = 8
    books.swap_out(s)
    assert not books.holds(s)
    assert books.swap_in(s) and books.holds(s)
    books.free(s)
    assert not books.holds(s)
    check_drained(cache)


def test_fork_and_swap_keep_the_stored_kv(backend):
    cache = build(backend, real=True)
    books, probe = cache.allocator, get_backend(backend).load_probe()
    parent = seq(0, 8)
    assert books.allocate(parent, 8) == 0
    write(cache, parent, 0, 8, seed=1)
    want = probe.read(cache, parent, 8).clone()
    child = seq(1, 8)
    child.num_computed_tokens = 8
    books.fork(parent, child)
    assert torch.equal(probe.read(cache, child, 8), want)
    books.swap_out(parent)
    assert books.swap_in(parent)
    assert torch.equal(probe.read(cache, parent, 8), want)
    for s in (parent, child):
        books.free(s)
    check_drained(cache)
    cache.close()
    cache.close()


def test_real_and_accounting_modes_decide_alike(backend):
    real, books = build(backend, real=True), build(backend)
    assert len(fill(real)) == len(fill(books))
    assert real.stats().used_units == books.stats().used_units
    real.close()
