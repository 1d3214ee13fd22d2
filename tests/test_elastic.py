"""The elastic backend's bar (docs/architecture.md "elastic"): its greedy tokens equal paged's; after every engine step
memory follows the blocks (a chunk is mapped exactly while it keeps a block, and while nothing has been freed the
mapped bytes exceed the held blocks' by less than one chunk per layer and K/V); an engine that frees everything
unmaps everything; page-aware placement never maps more than naive placement on the same run; and on CUDA (the
fake driver) the physical handles follow the mapped chunks."""
from __future__ import annotations

import random

import pytest
from helpers.invariants import SHAPE

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


def run_checked(placement: str, prefix: bool = False, cap: int = -1) -> dict[str, int]:
    """Drive an elastic engine step by step, checking memory against the blocks after every step; returns the
    worst slack (mapped chunks beyond what the held blocks fill, packed) and the end state."""
    llm = LLM(backend="elastic", elastic_placement=placement, enable_prefix_caching=prefix,
              elastic_cached_blocks=cap, **TINY)
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
