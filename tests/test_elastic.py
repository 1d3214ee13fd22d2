"""The elastic backend's bar (docs/architecture.md "elastic"): its greedy tokens equal paged's; after every engine step
memory follows the blocks (a chunk is mapped exactly while it keeps a block, and while nothing has been freed the
mapped bytes exceed the held blocks' by less than one chunk per layer and K/V); an engine that frees everything
unmaps everything; page-aware placement never maps more than naive placement on the same run; and on CUDA (the
fake driver) the physical handles follow the mapped chunks. With compaction (elastic_compact 0), after any operation,
frees in random order included, no chunk is mapped past what the held blocks need, and the tokens stay paged's."""
from __future__ import annotations

import random
from collections import Counter

import hypothesis.strategies as st
import pytest
from helpers.invariants import MAX_LEN, SHAPE, Workload
from hypothesis import HealthCheck, given, settings

from kvlab import LLM, SamplingParams
from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.seam import create_cache
from kvlab.common.kv.types import KVShape
from kvlab.elastic.geometry import ChunkGeometry
from kvlab.elastic.memory import ElasticMemory
from kvlab.elastic.probe import chunks_in_use

TINY = {"model": "tiny", "kv_cache_bytes": 8 * 2**20, "max_model_len": 512, "max_num_seqs": 8}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that share a 40-token prefix in pairs (prefix-cache hits) and differ after it."""
    rng = random.Random(seed)
    common = [[rng.randint(3, 250) for _ in range(40)] for _ in range(n // 2 + 1)]
    return [common[i // 2] + [rng.randint(3, 250) for _ in range(rng.randint(5, 120))] for i in range(n)]


def greedy(backend: str, prefix: bool, **opts) -> list[list[int]]:
    llm = LLM(backend=backend, enable_prefix_caching=prefix, **TINY, **opts)
    try:
        outs = llm.generate(prompts(10), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("prefix", [False, True])
def test_greedy_tokens_equal_paged(prefix):
    assert greedy("elastic", prefix) == greedy("paged", prefix)


def run_checked(placement: str, prefix: bool = False, cap: int = -1, compact: int = -1) -> dict[str, int]:
    """Drive an elastic engine step by step, checking memory against the blocks after every step; returns the
    worst slack (mapped chunks beyond what the held blocks fill, packed) and the end state."""
    llm = LLM(backend="elastic", elastic_placement=placement, enable_prefix_caching=prefix,
              elastic_cached_blocks=cap, elastic_compact=compact, **TINY)
    engine, rng = llm.engine, random.Random(1)
    for p in prompts(24, seed=2):
        engine.add_request(p, SamplingParams(max_tokens=rng.randint(1, 60), temperature=0.0, ignore_eos=True))
    worst = grow_worst = 0
    freed = False
    while engine.has_unfinished():
        freed |= bool(engine.step().finished)
        books, stats = engine.cache.allocator, engine.cache.stats()
        snap = books.snapshot()
        assert set(snap["mapped_chunks"]) == chunks_in_use(snap), "a chunk mapped without a block, or the reverse"
        assert books.memory.mapped_pages() * books.geo.page_size == stats.mapped_bytes
        held = stats.used_units + len(snap["cached_free"])
        slack = len(snap["mapped_chunks"]) - -(-held // snap["blocks_per_chunk"])
        worst = max(worst, slack)
        if not freed:
            grow_worst = max(grow_worst, slack)
    end = engine.cache.stats()
    result = {"worst": worst, "grow_worst": grow_worst, "end_mapped": end.mapped_bytes,
              "end_pages": engine.cache.allocator.memory.mapped_pages(), "peak": end.extra["chunk_maps"]}
    engine.close()
    return result


@pytest.mark.parametrize("placement", ["page-aware", "naive"])
def test_memory_follows_the_blocks_after_every_step(placement):
    r = run_checked(placement)
    assert r["grow_worst"] <= 1, f"{placement}: {r['grow_worst']} chunks mapped beyond the blocks before any free"
    assert r["end_mapped"] == 0 and r["end_pages"] == 0, f"{placement}: a drained engine still maps {r}"


def test_page_aware_placement_never_maps_more_than_naive():
    aware, naive = run_checked("page-aware"), run_checked("naive")
    assert aware["worst"] <= naive["worst"], (aware, naive)


def test_an_engine_that_frees_everything_unmaps_everything_even_with_a_prefix_cache_capped_at_zero():
    r = run_checked("page-aware", prefix=True, cap=0)
    assert r["end_mapped"] == 0 and r["end_pages"] == 0, r


def test_a_warm_prefix_cache_keeps_its_chunks_mapped():
    r = run_checked("page-aware", prefix=True)
    assert r["end_mapped"] > 0, "the free cached blocks' chunks were unmapped: their content is gone"


# -- compaction (elastic_compact): blocks move out of sparse chunks after frees ----------------------------------
@pytest.mark.slow     # ~15 s under load: three engine runs; the random-operations test below is the fast one
def test_compaction_keeps_mapped_memory_within_a_page_per_layer_and_kv_after_frees():
    """Requests finishing in random order leave live blocks spread over chunks: placement alone leaves chunks
    mapped past what the held blocks fill (5 on this run); with compaction there is none after any step."""
    loose, packed = run_checked("page-aware"), run_checked("page-aware", compact=0)
    assert loose["worst"] > 0, "the run no longer fragments: this test checks nothing"
    assert packed["worst"] == 0 and packed["end_mapped"] == 0, packed
    assert run_checked("page-aware", compact=1)["worst"] <= 1


@pytest.mark.parametrize("prefix", [False, True])
def test_greedy_tokens_with_compaction_equal_paged(prefix):
    llm = LLM(backend="elastic", enable_prefix_caching=prefix, elastic_compact=0, **TINY)
    try:
        outs = llm.generate(prompts(10), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        moves = llm.cache_stats().extra["compaction_moves"]
    finally:
        llm.engine.close()
    assert moves > 0, "nothing moved: the test checks nothing"
    assert [o.outputs[0].token_ids for o in outs] == greedy("paged", prefix)


SHARED = [list(range(10, 26)), list(range(40, 52))]     # prefixes of whole 4-token blocks: prefix-cache hits


def slack_chunks(allocator) -> int:
    """Mapped chunks past the fewest that hold the held blocks (referenced, or free and cached)."""
    pool = allocator.pool
    held = pool.num_used() + len(pool.cached_free)
    return len(pool.books.mapped) - -(-held // pool.books.geo.blocks_per_chunk)


def random_step(w: Workload, rng: random.Random) -> None:
    """One random operation of the scheduler's kinds; admissions start with a shared prefix half the time."""
    live, swapped, waiting = w.ids("live"), w.ids("swapped"), w.ids("waiting")
    op = rng.choice(["admit", "admit", "write", "write", "grow", "fork", "free", "free", "abort", "swap_out",
                     "swap_in", "preempt", "readmit"])
    if op == "admit":
        tail = [rng.randint(3, 999) for _ in range(rng.randint(1, 30))]
        prompt = (rng.choice(SHARED) + tail if rng.random() < 0.5 else tail)[:MAX_LEN - 1]
        w.admit(prompt, rng.randint(1, 30), rng.randint(1, len(prompt)))
    elif op == "readmit" and waiting:
        w.readmit(rng.choice(waiting), rng.randint(1, 40))
    elif op == "write" and live:
        w.write([(sid, rng.randint(1, 12)) for sid in rng.sample(live, min(len(live), rng.randint(1, 3)))])
    elif op in ("grow", "fork", "free", "preempt") and live:
        sid = rng.choice(live)
        w.grow(sid, rng.randint(1, 12)) if op == "grow" else getattr(w, op)(sid)
    elif op == "abort" and w.tracked:
        w.abort(rng.choice(sorted(w.tracked)))
    elif op == "swap_out" and (computed := [s for s in live if w.seq(s).num_computed_tokens]):
        w.swap_out(rng.choice(computed))
    elif op == "swap_in" and swapped:
        w.swap_in(swapped[0])


def compaction_property(seed: int, prefix: bool, ops: int) -> Counter:
    """Random operations on a small real elastic cache with compaction: after each, every check of the reliability
    workload (its books, and its K/V read back through the block tables, so moved blocks kept their data) and no
    chunk mapped past what the held blocks need: mapped bytes within one page per layer and K/V of theirs."""
    rng = random.Random(seed)
    w = Workload("elastic", False, seed, elastic_compact=0, enable_prefix_caching=prefix, check_invariants=True)
    for _ in range(ops):
        random_step(w, rng)
        w.check()
        assert slack_chunks(w.cache) <= 0, f"{slack_chunks(w.cache)} chunks mapped past the held blocks' need"
    moves = w.cache.stats().extra["compaction_moves"]
    w.drain()
    return w.ops + Counter(moves=moves)


@pytest.mark.parametrize("prefix", [False, True])
def test_compaction_keeps_memory_within_a_page_of_the_blocks_over_random_operations(prefix):
    totals = Counter()
    for seed in range(3):
        totals += compaction_property(seed, prefix, 60)
    assert totals["moves"] > 0 and totals["free"] > 0 and (totals["prefix_hit_tokens"] > 0) == prefix, totals


def test_an_allocation_that_maps_chunk_0_again_as_padding_is_compacted():
    """Found by the long property below (seed 2697256): with prefix caching, chunk 0 is unmapped once no block is
    in use while cached blocks keep another chunk mapped; the next allocation maps chunk 0 again as the tables'
    padding, a chunk past the held blocks' need until a free compacted. Compaction now runs after allocations
    too. Seed 24 of the same workload reaches that state at its 27th operation."""
    compaction_property(24, True, 27)


@pytest.mark.slow
@given(seed=st.integers(0, 2**31 - 1), prefix=st.booleans())
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_compaction_keeps_memory_within_a_page_of_the_blocks_long(seed, prefix):
    compaction_property(seed, prefix, 150)


def test_the_compaction_option_is_checked():
    with pytest.raises(ConfigError, match="elastic_compact must be -1") as e:
        make_config(backend="elastic", elastic_compact=-2)
    assert "\n" not in str(e.value)


def test_the_blocks_are_paged_s_and_a_partial_last_chunk_maps_only_its_pages():
    geo = ChunkGeometry.of(SHAPE, 4, 4096, 100 * 1024)   # a plane block of 1 KiB, 4 planes: 25 blocks, 4 a chunk
    assert (geo.blocks_per_chunk, geo.num_chunks, geo.num_blocks) == (4, 7, 25) and geo.pages_of(6) == 1
    everything = sum(geo.mapped_bytes(c) for c in range(geo.num_chunks))
    assert 100 * 1024 <= everything < 100 * 1024 + geo.planes * geo.page_size
    odd = ChunkGeometry.of(KVShape(num_layers=1, num_kv_heads=3, head_dim=32, num_q_heads=3), 4, 4096, 1 << 20)
    assert odd.chunk_bytes == 3 * 4096 and odd.blocks_per_chunk == 8     # lcm(4 KiB, 1.5 KiB)
    config = make_config(backend="elastic", kv_cache_bytes=2048, elastic_block_size=4, elastic_page_size=4096)
    with pytest.raises(ConfigError, match="smaller than one block"):   # a block of SHAPE takes 4 KiB
        create_cache(config, SHAPE, accounting_only=True)


def test_on_cuda_the_physical_handles_follow_the_mapped_chunks(monkeypatch):
    from fakes.fake_cuda import FakeCudaDriver, torch_interop

    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    fake = FakeCudaDriver(granularity=2 * 2**20)
    torch_interop(monkeypatch, fake)
    shape = KVShape(num_layers=2, num_kv_heads=8, head_dim=128, num_q_heads=8, dtype="float16", device="cuda")
    geo = ChunkGeometry.of(shape, 16, 2 * 2**20, 64 * 2**20)     # 32 KiB plane blocks: 64 per 2 MiB chunk
    memory = ElasticMemory(CudaVirtualMemory(0, driver=fake), geo)
    assert (geo.blocks_per_chunk, geo.num_chunks) == (64, 8) and not fake.handles
    memory.map_chunk(0)
    memory.map_chunk(3)
    assert len(fake.handles) == 2 * geo.planes, "chunks 1 and 2 (below the highest) must hold no memory"
    memory.unmap_chunk(3)
    assert len(fake.handles) == geo.planes and memory.mapped_pages() == geo.planes
    memory.close()
    assert fake.leaks() == {}


@pytest.mark.slow
def test_page_aware_placement_brings_the_idle_footprint_to_its_floor():
    """kvcached #359 in small: the same cached blocks kept, naive placement pins more chunks than they fill."""
    from kvlab.experiments.studies.idle_footprint import idle_footprint
    naive, aware = (idle_footprint(p, cap=32, num_requests=20, kv_cache_bytes=8 * 2**20)
                    for p in ("naive", "page-aware"))
    assert naive["cached_blocks"] == aware["cached_blocks"] == 32
    assert aware["idle_mapped_bytes"] <= aware["packed_bytes"] + aware["chunk_bytes"], aware
    assert aware["idle_mapped_bytes"] < naive["idle_mapped_bytes"], (aware, naive)


def test_compaction_is_refused_on_an_engine_with_a_kv_handoff():
    """A handoff reads block tables from its own thread; compaction would move blocks under it."""
    from kvlab.common.config import make_config
    from kvlab.common.errors import ConfigError
    from kvlab.common.kv.seam import create_cache
    from kvlab.common.kv.types import KVShape
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4)
    config = make_config(backend="elastic", elastic_compact=0, kv_role="prefill", kv_cache_bytes=1 << 20,
                         max_model_len=256)
    with pytest.raises(ConfigError, match="elastic_compact .* kv_role 'prefill'"):
        create_cache(config, shape, accounting_only=True)
