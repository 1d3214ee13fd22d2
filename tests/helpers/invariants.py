"""Shared helpers for the reliability tests (issue 8).

`Workload` drives one KV-cache backend the way the scheduler, runner and model do (admit, grow, fork, write,
free, abort, swap, preempt) and keeps its own reference model of what the cache must hold. `check()` compares
the backend's books against that model after every operation, independently of the backend's own
`check_invariants()`: capacity balance, reference counts recounted from the tables or slots, physical pages
mapped twice only between forks (or, with prefix caching, at the same logical block of an identical prefix),
every computed token backed, and in real mode the stored K/V read back through a second path (block tables
into the pool tensor, the memfd pool pages under the vmm mappings, the reserve arena rows).

K/V written for position p is a pseudo-random function of the token prefix [0, p] and the layer, as in a real
model: two sequences with the same prefix (forks, prefix-cache hits) expect the same K/V, and a write into a
page or block that another sequence still uses shows up as a mismatch there.
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import random
import threading
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.config import EngineConfig, make_config
from kvlab.common.errors import OutOfKVCache
from kvlab.common.kv.registry import get_backend
from kvlab.common.kv.seam import Allocator, KVCache, create_cache
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, num_q_heads=4)   # 256 B per token per layer
PAGE = 4096                                                                   # vmm: 16 tokens per page
MAX_LEN = 64
VOCAB = 1000
SCALE = SHAPE.head_dim ** -0.5
TOKEN_BYTES = SHAPE.bytes_per_token


BASE = {"max_model_len": MAX_LEN, "max_num_seqs": 5, "max_num_batched_tokens": 64, "watermark": 0.0}


def backend_config(backend: str, **overrides) -> EngineConfig:
    """A tiny cache of `backend` for the state machines: the sizes its probe declares for SHAPE."""
    sizes = get_backend(backend).load_probe().test_options
    return make_config(**{"backend": backend, **BASE, **sizes, **overrides})


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: a second OpenMP thread only spins on a shared 2-core machine (SDPA 0.1 -> 3 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- process-level leak probes --------------------------------------------------------------------------------
def kvlab_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvlab") and t.is_alive()}


def memfd_mappings() -> int:
    """VMAs of the host VMM pool (memfd "kvlab-kv") plus its open descriptors, from /proc/self."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:kvlab-kv" in line) + memfd_fds()


def memfd_fds() -> int:
    """Open file descriptors of the host VMM pool (memfd "kvlab-kv") in this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:kvlab-kv" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # the descriptor of the listing itself is gone by now
            pass
    return count


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def settled_rss() -> int:
    """VmRSS after a full collection and glibc's malloc_trim (freed heap pages go back to the OS)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_bytes()


# -- the reference model ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Tracked:
    seq: Sequence
    family: int                        # fork family: the id of the sequence it descends from
    state: str = "live"                # live | swapped | waiting (preempted by recompute, holds nothing)
    # sliding window: the model's view of what the window let the cache drop
    alloc_tokens: int = 0              # the most tokens an allocate asked it to hold
    alloc_computed: int = 0            # its computed tokens at its last allocate (the window trims from there)
    first_needed: int = 0              # the first key position the queries of its last allocate read
    dropped: int = 0                   # leading units the window dropped (they went back to the pool)


@dataclass
class ExpectedKV:
    """K/V of position p in layer l = f(hash of tokens[0..p], l); memoised per prefix hash."""
    shape: KVShape
    _values: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def prefix_hashes(tokens: list[int]) -> list[int]:
        out, h = [], 0
        for t in tokens:
            h = hash((h, t))
            out.append(h)
        return out

    def value(self, prefix_hash: int, layer: int) -> torch.Tensor:
        key = (prefix_hash, layer)
        if key not in self._values:
            g = torch.Generator().manual_seed((prefix_hash * 31 + layer) & 0x7FFF_FFFF_FFFF_FFFF)
            self._values[key] = torch.randn(2, self.shape.num_kv_heads, self.shape.head_dim, generator=g)
        return self._values[key]

    def of(self, tokens: list[int], start: int, end: int) -> torch.Tensor:
        """[L, 2, end - start, H_kv, D] for positions [start, end)."""
        hashes = self.prefix_hashes(tokens[:end])[start:end]
        if not hashes:
            return torch.zeros(self.shape.num_layers, 2, 0, self.shape.num_kv_heads, self.shape.head_dim)
        return torch.stack([torch.stack([self.value(h, layer) for h in hashes], dim=1)
                            for layer in range(self.shape.num_layers)])


# -- independent structural checks (each backend's own through its probe) --------------------------------------
def probe_of(cache: KVCache):
    return get_backend(cache.name).load_probe()


def own_free_units(cache: Allocator) -> int:
    """The cache's own free units: on a pool, before what the pool can give now (which other engines change)."""
    if not on_a_pool(cache):
        return cache.num_free_units()
    return cache.growth.free_units() if cache.name == "vmm" else cache.pool.num_free()


def on_a_pool(cache: Allocator) -> bool:
    """A vmm or elastic cache whose pages come from a machine-wide pool (its MachinePool is not the do-nothing
    one; elastic's `pool` is its block pool)."""
    machine_pool = {"vmm": "pool", "elastic": "machine_pool"}.get(cache.name)
    return machine_pool is not None and getattr(cache, machine_pool).elastic


def check_capacity(cache: Allocator) -> None:
    st = cache.stats()
    assert st.free_units + st.used_units == st.total_units == cache.num_total_units(), (
        f"free {st.free_units} + used {st.used_units} != total {st.total_units}")
    assert 0 <= st.used_units <= st.total_units
    if on_a_pool(cache):                    # on a pool: what the pool can give now, within the engine's own free
        assert 0 <= cache.num_free_units() <= st.free_units
    else:
        assert st.free_units == cache.num_free_units()


def check_holds(cache: Allocator, tracked: dict[int, Tracked]) -> None:
    """`holds` means KV resident in the cache: a swapped-out or waiting sequence is not held (every backend)."""
    for t in tracked.values():
        want = t.state == "live"
        assert cache.holds(t.seq) is want, f"holds({t.seq.seq_id}) is {not want} for a {t.state} sequence"


def sharing_rule(tracked: dict[int, Tracked], unit_tokens: int, prefix_caching: bool):
    """may_share(a, b, index): same fork family, or (prefix caching) equal tokens through that unit."""
    def may_share(sid_a: int, sid_b: int, index: int) -> bool:
        a, b = tracked[sid_a], tracked[sid_b]
        if a.family == b.family:
            return True
        end = (index + 1) * unit_tokens
        return prefix_caching and a.seq.token_ids[:end] == b.seq.token_ids[:end] and len(a.seq.token_ids) >= end
    return may_share


def check_structure(cache: KVCache, tracked: dict[int, Tracked], prefix_caching: bool = False) -> None:
    books = cache.allocator
    books.check_invariants()
    check_capacity(books)
    check_holds(books, tracked)
    live = {sid: t.seq for sid, t in tracked.items() if t.state == "live"}
    swapped = {sid for sid, t in tracked.items() if t.state == "swapped"}
    probe_of(cache).check_structure(cache, live, swapped,
                                    sharing_rule(tracked, books.tokens_per_unit, prefix_caching))


def check_drained(cache: KVCache) -> None:
    """Nothing is held once every sequence is gone: no units, tables, slots, regions or host swap copies."""
    st = cache.stats()
    assert st.used_units == 0 and st.live_tokens == 0, f"leak: {st.used_units} units, {st.live_tokens} tokens"
    assert st.free_units == st.total_units
    probe_of(cache).check_drained(cache)


def check_closed(cache: KVCache, threads_before: set[threading.Thread], memfd_before: int) -> None:
    """After close(): no new background threads or memfd mappings; the backend released what it held."""
    cache.close()
    cache.close()   # idempotent
    alive = kvlab_threads() - threads_before
    assert not alive, f"background threads still alive after close: {sorted(t.name for t in alive)}"
    assert memfd_mappings() <= memfd_before, "the memfd pool is still mapped or open after close"
    probe_of(cache).check_closed(cache)


# -- an engine on a shared pool (issue 29) -----------------------------------------------------------------------
def kernel_pool_maps(pool_name: str, page_size: int, regions: list) -> dict[int, int]:
    """Address -> pool page of every page the kernel maps from pool `pool_name`'s memfd into `regions` (read from
    /proc/self/maps: each VMA's range and file offset), whoever's books say what."""
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            if f"memfd:kvlab-pool-{pool_name}-pages" not in line:
                continue
            span, _, offset = line.split()[:3]
            start, end = (int(x, 16) for x in span.split("-"))
            if any(r.base <= start < r.base + r.nbytes for r in regions):
                first = int(offset, 16) // page_size
                out.update((start + i * page_size, first + i) for i in range((end - start) // page_size))
    return out


def check_pool(cache: KVCache) -> None:
    """The pool's books say the engine holds exactly the pool pages its driver backs local pages with, one local
    page each; the kernel maps into the engine's ranges exactly those of its mapped local pages, at their
    addresses: so it reads and writes no page the books give another engine; every page it holds is in use, a
    spare, kept (prefix-cached data, exactly the cache's groups) or loose (held for maps to come)."""
    allocator = cache.allocator
    driver, member = allocator.driver, allocator.driver.member
    elastic = allocator.name == "elastic"
    with allocator.lock if elastic else allocator._lock:   # the pool's steward thread gives pages back under it
        memory = driver.os
        backing, owned, loose = dict(memory.backing), member.owned(), list(memory.loose)
        want = {addr: backing[page] for addr, page in memory.mapped.items()}
        kernel = kernel_pool_maps(member.name, driver.page_size, driver.regions)
        in_use, idle, kept = set(memory.refs), set(memory.idle), set(memory.kept)
        # elastic keeps no pages: a cached block keeps its chunk mapped instead
        cached = len(allocator.prefix.cache) if not elastic and allocator.prefix is not None else 0
        held = member.record().held
    assert len(set(backing.values())) == len(backing), "two local pages share one pool page"
    assert sorted([*backing.values(), *loose]) == owned and held == len(owned), \
        f"the books give the engine {len(owned)} pages (held {held}), its driver backs {len(backing)}"
    assert kernel == want, "the kernel maps pool pages the driver does not list (or misses some)"
    assert len(kept) == cached * (0 if elastic else allocator.geo.num_tensors) and kept <= set(backing), \
        "the driver keeps other pages than the prefix cache's, or lost one's pool page"
    assert not in_use & idle and not idle & kept and in_use | idle | kept == set(backing), \
        "a held pool page is neither mapped, spare nor kept (or two of them)"


def check_pool_books(status) -> None:
    """The books' totals: every page is free or held by one engine."""
    assert status.used == sum(e.held for e in status.engines) and 0 <= status.free <= status.total, status


# -- the workload -----------------------------------------------------------------------------------------------
class Workload:
    """One backend plus the reference model. Every op counts itself in `ops` when it reaches the cache;
    refusals (OutOfKVCache) are counted in `ops["refused"]` and must leave the cache unchanged."""

    def __init__(self, backend: str, accounting_only: bool, seed: int = 0, window: int | None = None,
                 **overrides) -> None:
        self._threads_before, self._memfd_before = kvlab_threads(), memfd_mappings()
        self.config = backend_config(backend, **overrides)
        self.backend = backend
        self.accounting_only = accounting_only
        self.kv = create_cache(self.config, dataclasses.replace(SHAPE, sliding_window=window),
                               accounting_only=accounting_only)
        self.shape = self.kv.shape          # the config's kv_cache_dtype decides the stored bytes
        self.window = window
        if self.shape.fp8_dtype is not None:
            check_fp8_capacity(self.config, self.kv)
        self.cache = self.kv.allocator
        self.tracked: dict[int, Tracked] = {}
        self.ops: Counter[str] = Counter()
        self.expected = ExpectedKV(SHAPE)
        self.gen = torch.Generator().manual_seed(seed)
        self._next_id = 0

    # -- views of the model
    def ids(self, state: str) -> list[int]:
        return sorted(sid for sid, t in self.tracked.items() if t.state == state)

    def seq(self, sid: int) -> Sequence:
        return self.tracked[sid].seq

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- guarded cache calls
    def _snapshot(self) -> tuple[int, dict[int, bool]]:
        return own_free_units(self.cache), {sid: self.cache.holds(t.seq) for sid, t in self.tracked.items()}

    def _refused(self, before: tuple[int, dict[int, bool]], what: str) -> None:
        self.ops["refused"] += 1
        after = self._snapshot()
        assert after[0] == before[0], f"a refused {what} changed the free units {before[0]} -> {after[0]}"
        assert after[1] == before[1], f"a refused {what} changed which sequences the cache holds"

    def _allocate(self, seq: Sequence, n: int) -> int | None:
        """allocate(seq, n), checking it takes exactly what units_needed said, and that a refusal (None)
        changed nothing. None when refused."""
        need = self.cache.units_needed(seq, n)
        before = self._snapshot()
        held_before = self._window_units()
        hit = self.cache.allocate(seq, n)
        if hit is None:
            self._refused(before, "allocate")
            return None
        assert need <= before[0], f"allocate({seq.seq_id}, {n}) succeeded with {need} units needed, {before[0]} free"
        used = before[0] - own_free_units(self.cache)
        released = self._after_window_allocate(self.tracked[seq.seq_id], n, held_before) if self.window else 0
        assert used == need - released, (
            f"allocate({seq.seq_id}, {n}) took {used} units: units_needed said {need}, the window released {released}")
        return hit

    def _window_units(self) -> dict[int, tuple[int, list[int]]]:
        return probe_of(self.kv).window_units(self.kv) if self.window is not None else {}

    def _after_window_allocate(self, t: Tracked, n: int, held_before: dict[int, tuple[int, list[int]]]) -> int:
        """The window drops exactly the units wholly below the first key this step's queries read (the model
        recomputes it); counts the trims. Returns how many of the dropped units no other sequence holds (they go
        back to the pool; the same call may take them again): units_needed does not net them out, so the free
        count ends exactly that many above what it said."""
        unit = self.cache.tokens_per_unit
        t.alloc_computed = t.seq.num_computed_tokens
        t.first_needed = max(t.alloc_computed - self.window + 1, 0)
        t.alloc_tokens = max(t.alloc_tokens, n)
        sid = t.seq.seq_id
        dropped = self._window_units()[sid][0]
        want = max(t.dropped, t.first_needed // unit)
        assert dropped == want, f"seq {t.seq.seq_id}: the window dropped {dropped} units, the model says {want}"
        trimmed = held_before.get(sid, (0, []))[1][:dropped - t.dropped]
        if trimmed:
            self.ops["trims"] += 1
            self.ops["trimmed_units"] += len(trimmed)
        t.dropped = dropped
        others = {u for other, (_, units) in held_before.items() if other != sid for u in units}
        return sum(1 for u in trimmed if u not in others)

    # -- operations
    def admit(self, prompt: list[int], max_tokens: int, chunk: int) -> None:
        sid = self._new_id()
        seq = Sequence(sid, str(sid), prompt, max_tokens=max(1, min(max_tokens, MAX_LEN - len(prompt))))
        self.tracked[sid] = Tracked(seq, family=sid, state="waiting")
        self.ops["admit"] += 1
        self._admit(sid, chunk)

    def readmit(self, sid: int, chunk: int) -> None:
        """A waiting (refused or preempted) sequence is admitted again from position 0."""
        self.ops["readmit"] += 1
        self._admit(sid, chunk)

    def _admit(self, sid: int, chunk: int) -> None:
        t = self.tracked[sid]
        seq = t.seq
        target = max(1, min(chunk, seq.num_tokens))
        hit = self._allocate(seq, target)
        if hit is None:
            return
        t.state = "live"
        if hit:   # as the scheduler: a prefix hit skips computing those tokens (never the last one)
            self.ops["prefix_hit_tokens"] += hit
            seq.num_computed_tokens = max(seq.num_computed_tokens, min(hit, seq.num_tokens - 1))
        if target > seq.num_computed_tokens:   # the admission step computes its chunk
            self._write([(sid, target - seq.num_computed_tokens)])

    def grow(self, sid: int, n: int) -> None:
        """Allocate ahead without computing (a step that is then preempted or aborted)."""
        seq = self.seq(sid)
        self._extend(seq)
        target = min(seq.num_tokens, seq.num_computed_tokens + n)
        self.ops["grow"] += 1
        if target > seq.num_computed_tokens:
            self._allocate(seq, target)

    def _extend(self, seq: Sequence) -> None:
        """A decode step: the sampled token is appended before the next allocate."""
        if seq.num_computed_tokens == seq.num_tokens and seq.num_tokens < min(seq.final_len, MAX_LEN):
            seq.append_token(int(torch.randint(3, VOCAB, (1,), generator=self.gen)))

    def write(self, picks: list[tuple[int, int]]) -> None:
        """One step over several sequences: allocate each, then (real mode) prepare + attention per layer."""
        self.ops["write"] += 1
        self._write(picks)

    def _write(self, picks: list[tuple[int, int]]) -> None:
        items = []
        for sid, n in picks:
            seq = self.seq(sid)
            self._extend(seq)
            start = seq.num_computed_tokens
            n = min(n, seq.num_tokens - start)
            if n > 0 and self._allocate(seq, start + n) is not None:
                items.append(BatchItem(seq, start, n, start + n == seq.num_tokens))
        if not items:
            return
        if not self.accounting_only:
            self._compute(items)
        for it in items:
            it.seq.num_computed_tokens = it.context_len
        self.ops["tokens_written"] += sum(it.num_tokens for it in items)

    def _compute(self, items: list[BatchItem]) -> None:
        meta = self.kv.storage.prepare(items)
        meta.sliding_window = self.window   # as the model does (common/model.py): prepare leaves it to the caller
        s = self.shape
        new = [self.expected.of(it.seq.token_ids, it.start, it.context_len) for it in items]
        for layer in range(s.num_layers):
            q = torch.randn(meta.num_tokens, s.num_q_heads, s.head_dim, generator=self.gen)
            k = torch.cat([x[layer, 0] for x in new])
            v = torch.cat([x[layer, 1] for x in new])
            out = self.kv.storage.attention(layer, q, k, v, meta, SCALE)
            torch.testing.assert_close(out, self._reference(items, q, layer), rtol=1e-4, atol=1e-5)

    def _reference(self, items: list[BatchItem], q: torch.Tensor, layer: int) -> torch.Tensor:
        outs, row = [], 0
        group = SHAPE.num_q_heads // SHAPE.num_kv_heads
        for it in items:
            kv = self.expected.of(it.seq.token_ids, 0, it.context_len)[layer]
            keys, values = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (kv[0], kv[1]))
            keys_at, queries_at = torch.arange(it.context_len)[None, :], torch.arange(it.start, it.context_len)[:, None]
            mask = keys_at <= queries_at
            if self.window is not None:   # each query reads its last W keys only
                mask &= keys_at > queries_at - self.window
            part = q[row:row + it.num_tokens].transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(part, keys, values, attn_mask=mask, scale=SCALE)
                        .transpose(0, 1))
            row += it.num_tokens
        return torch.cat(outs)

    def fork(self, sid: int) -> None:
        parent = self.tracked[sid]
        cid = self._new_id()
        p = parent.seq
        child = Sequence(cid, str(cid), p.token_ids[:p.prompt_len], p.max_tokens)
        child.token_ids = list(p.token_ids)
        child.num_computed_tokens = p.num_computed_tokens
        child.parent_id = sid
        self.ops["fork"] += 1
        before = self._snapshot()
        try:
            self.cache.fork(p, child)
        except OutOfKVCache:
            self._refused(before, "fork")
            return
        self.tracked[cid] = dataclasses.replace(parent, seq=child)

    def free(self, sid: int) -> None:
        self.cache.free(self.seq(sid))
        del self.tracked[sid]
        self.ops["free"] += 1

    def abort(self, sid: int) -> None:
        """Drop a sequence wherever it is: live, swapped (the host copy goes) or waiting (nothing to free)."""
        t = self.tracked.pop(sid)
        if t.state != "waiting":
            self.cache.free(t.seq)
        self.ops["abort"] += 1

    def swap_out(self, sid: int) -> None:
        self.cache.swap_out(self.seq(sid))
        self.tracked[sid].state = "swapped"
        self.ops["swap_out"] += 1

    def swap_in(self, sid: int) -> None:
        self.ops["swap_in"] += 1
        seq = self.seq(sid)
        before = self._snapshot()
        if not self.cache.swap_in(seq):
            self._refused(before, "swap_in")
            return
        self.tracked[sid].state = "live"

    def preempt(self, sid: int) -> None:
        """Recompute preemption: free the KV, forget the progress, wait for readmission."""
        seq = self.seq(sid)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        self.tracked[sid] = Tracked(seq, self.tracked[sid].family, "waiting")
        self.ops["preempt"] += 1

    # -- checks
    def check(self) -> None:
        check_structure(self.kv, self.tracked, self.config.enable_prefix_caching)
        self.ops["checks"] += 1
        if self.config.kv_pool is not None and not self.accounting_only:
            check_pool(self.kv)
        if self.window is not None:
            self._check_window()
        if self.accounting_only:
            return
        read = probe_of(self.kv).read
        for sid in self.ids("live"):
            seq = self.seq(sid)
            n = seq.num_computed_tokens
            first = min(self.tracked[sid].first_needed, n)   # below it the window dropped the K/V
            stored = read(self.kv, seq, n)[:, :, first:]
            want = self.expected.of(seq.token_ids, first, n)
            assert torch.equal(stored, want), f"seq {sid}: stored K/V differ from what was written"

    def _check_window(self) -> None:
        """A window sequence holds no more units than the window needs (ceil(W / unit) + 1 while it decodes), what
        the window dropped went back to the free count exactly, and nothing drops but at an allocate."""
        unit, w = self.cache.tokens_per_unit, self.window
        held = probe_of(self.kv).window_units(self.kv)
        assert set(held) == set(self.ids("live")), f"window units of {sorted(held)} != live {self.ids('live')}"
        in_use: set[int] = set()
        for sid, (dropped, units) in held.items():
            t = self.tracked[sid]
            assert dropped == t.dropped, f"seq {sid}: {dropped} units dropped, {t.dropped} at its last allocate"
            bound = -(-t.alloc_tokens // unit) - t.first_needed // unit   # units of [first_needed, alloc_tokens)
            assert len(units) <= bound, f"seq {sid} holds {len(units)} units, its window needs {bound}"
            if t.alloc_tokens <= t.alloc_computed + 1:                    # decoding: the backends' promise
                assert len(units) <= -(-w // unit) + 1, f"seq {sid} decodes with {len(units)} units, W={w}"
            in_use.update(units)
        free, total = own_free_units(self.cache), self.cache.num_total_units()
        assert free == total - len(in_use), f"{free} units free, {total} - {len(in_use)} in use expected"

    def drain(self) -> None:
        """Abort everything, check nothing is left, close, check nothing survives the close."""
        for sid in list(self.tracked):
            self.abort(sid)
        self.check()
        check_drained(self.kv)
        check_closed(self.kv, self._threads_before, self._memfd_before)

    @property
    def num_ops(self) -> int:
        """Operations run against the cache (refused ones included; the checks after each are not counted)."""
        return sum(self.ops[k] for k in OPS)


OPS = ("admit", "readmit", "grow", "write", "fork", "free", "abort", "swap_out", "swap_in", "preempt")


def token_capacity(config: EngineConfig, dtype: str, kv_cache_dtype: str) -> tuple[int, int]:
    """(tokens the budget holds, bytes per token) of config's backend at this compute and KV dtype (accounting)."""
    cache = create_cache(dataclasses.replace(config, kv_cache_dtype=kv_cache_dtype),
                         dataclasses.replace(SHAPE, dtype=dtype), accounting_only=True)
    try:
        st = cache.stats()
        return st.total_units * st.tokens_per_unit, cache.shape.bytes_per_token
    finally:
        cache.close()


def check_fp8_capacity(config: EngineConfig, kv: KVCache) -> None:
    """An fp8 cache stores 1-byte K/V: its byte budget holds exactly twice the tokens of bf16, four times fp32."""
    st = kv.stats()
    tokens = st.total_units * st.tokens_per_unit
    assert kv.shape.itemsize == 1 and kv.shape.bytes_per_token == SHAPE.bytes_per_token // 4
    assert st.extra["kv_cache_dtype"] == config.kv_cache_dtype
    assert tokens * kv.shape.bytes_per_token <= config.kv_cache_bytes, "the fp8 cache holds more than its budget"
    bf16, bf16_bytes = token_capacity(config, "bfloat16", "auto")
    fp32, _ = token_capacity(config, "float32", "auto")
    assert bf16_bytes == 2 * kv.shape.bytes_per_token
    assert tokens == 2 * bf16 == 4 * fp32, f"fp8 holds {tokens} tokens: bf16 {bf16}, fp32 {fp32}"


def random_workload(backend: str, accounting_only: bool, seed: int, num_ops: int, **overrides) -> Counter:
    """Seeded random operations (plain `random`, no hypothesis) with the full check after each; drains at the
    end. Used in subprocesses, where a bad mapping would kill the process by a signal."""
    rng = random.Random(seed)
    w = Workload(backend, accounting_only, seed, **overrides)
    kinds = ["admit", "admit", "write", "write", "write", "grow", "fork", "free", "abort", "swap_out", "swap_in",
             "preempt", "readmit"]
    for _ in range(num_ops):
        live, swapped, waiting = w.ids("live"), w.ids("swapped"), w.ids("waiting")
        computed = [s for s in live if w.seq(s).num_computed_tokens]
        op = rng.choice(kinds)
        if op == "admit":
            n = rng.randint(1, MAX_LEN - 1)
            w.admit([rng.randint(3, VOCAB) for _ in range(n)], rng.randint(1, 40), rng.randint(1, n))
        elif op == "readmit" and waiting:
            w.readmit(rng.choice(waiting), rng.randint(1, 40))
        elif op == "write" and live:
            picks = rng.sample(live, min(len(live), rng.randint(1, 3)))
            w.write([(sid, rng.randint(1, 20)) for sid in picks])
        elif op in ("grow", "fork", "free", "preempt") and live:
            sid = rng.choice(live)
            w.grow(sid, rng.randint(1, 20)) if op == "grow" else getattr(w, op)(sid)
        elif op == "abort" and w.tracked:
            w.abort(rng.choice(sorted(w.tracked)))
        elif op == "swap_out" and computed:
            w.swap_out(rng.choice(computed))
        elif op == "swap_in" and swapped:
            w.swap_in(swapped[0])
        w.check()
    w.drain()
    return w.ops


# -- the engine without a model ---------------------------------------------------------------------------------
EOS = 2


class FakeClockRunner(ABC):
    """A runner without a model: a step counter is the clock, and every item that needs logits gets the
    candidates `candidates` proposes, as many as its spec asks for."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def execute(self, out) -> dict[int, list[tuple[int, float]]]:
        self.now += 1.0
        return {it.seq.seq_id: self.candidates(it.seq, out.specs[it.seq.seq_id].num_samples)
                for it in out.items if it.needs_logits}

    @abstractmethod
    def candidates(self, seq: Sequence, k: int) -> list[tuple[int, float]]:
        """k distinct tokens with descending log-probabilities."""


class CheapRunner(FakeClockRunner):
    """Random distinct tokens (EOS now and then) from one seeded generator."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def candidates(self, seq: Sequence, k: int) -> list[tuple[int, float]]:
        tokens = self.rng.sample(range(EOS, EOS + 60), k)
        logprobs = sorted((-5 * self.rng.random() for _ in range(k)), reverse=True)
        return list(zip(tokens, logprobs))
