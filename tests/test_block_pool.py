"""The block pool (free queue + reference counts) and the prefix cache's hashing and collision guard."""
import random
import time

import pytest

from kvlab.common.errors import OutOfKVCache
from kvlab.paged.block_pool import BlockPool, BlockPoolError
from kvlab.paged.prefix_cache import PrefixCache, chain_keys


def test_allocate_until_empty_then_out_of_kv_cache():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and pool.num_free() == 0 and pool.num_used() == 4
    with pytest.raises(OutOfKVCache, match="all 4 KV blocks are in use"):
        pool.allocate()
    pool.check_invariants()


def test_release_returns_the_block_and_double_free_is_an_error():
    pool = BlockPool(3)
    block = pool.allocate()
    pool.release(block)
    assert pool.num_free() == 3 and pool.ref_counts[block] == 0
    with pytest.raises(BlockPoolError, match=f"block {block} released with reference count 0"):
        pool.release(block)
    pool.check_invariants()


def test_unknown_block_id_is_an_error():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match="outside the pool"):
        pool.release(7)
    with pytest.raises(BlockPoolError, match="outside the pool"):
        pool.share(-1)


def test_shared_block_stays_used_until_every_reference_is_released():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.share(block)
    pool.share(block)
    assert pool.ref_counts[block] == 3
    pool.release(block)
    pool.release(block)
    assert not pool.is_free(block) and pool.num_free() == 1
    pool.release(block)
    assert pool.is_free(block) and pool.num_free() == 2
    pool.check_invariants()


def test_uncached_blocks_are_reused_first_cached_ones_last():
    cache = PrefixCache()
    pool = BlockPool(4, cache)
    a, b, *_ = (pool.allocate() for _ in range(4))
    cache.insert(a, 111, (None, "", (1,)))
    pool.release(a)          # cached -> back of the queue
    pool.release(b)          # uncached -> front
    assert pool.allocate() == b
    assert pool.allocate() == a           # only a is free: evicted and handed out
    assert not cache.is_cached(a) and cache.lookup(111, (None, "", (1,))) is None
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    cache = PrefixCache()
    pool = BlockPool(3, cache)
    blocks = [pool.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        cache.insert(block, i, (None, "", (i,)))
    for block in (blocks[2], blocks[0], blocks[1]):
        pool.release(block)
    assert [pool.allocate() for _ in range(3)] == [blocks[2], blocks[0], blocks[1]]


def test_share_revives_a_freed_cached_block():
    cache = PrefixCache()
    pool = BlockPool(2, cache)
    block = pool.allocate()
    cache.insert(block, 7, (None, "", (5,)))
    pool.release(block)
    assert pool.is_free(block)
    pool.share(block)
    assert not pool.is_free(block) and pool.ref_counts[block] == 1 and cache.is_cached(block)
    assert pool.allocate() != block
    pool.check_invariants()


def test_invariants_catch_corruption():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.ref_counts[block] = 0
    with pytest.raises(AssertionError, match="used 0 \\+ free 1 != total 2"):
        pool.check_invariants()


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    cache = PrefixCache()
    pool = BlockPool(32, cache)
    refs: list[int] = []
    for step in range(2000):
        action = rng.random()
        if action < 0.4 and pool.num_free():
            block = pool.allocate()
            refs.append(block)
            if rng.random() < 0.3:
                cache.insert(block, step, (None, "", (step,)))
        elif action < 0.6 and refs:
            block = rng.choice(refs)
            pool.share(block)
            refs.append(block)
        elif refs:
            pool.release(refs.pop(rng.randrange(len(refs))))
        pool.check_invariants()
        assert pool.num_used() == len(set(refs))
        assert all(pool.ref_counts[b] == refs.count(b) for b in set(refs))


# -- prefix cache -------------------------------------------------------------------------------------------
def test_chain_hash_depends_on_prefix_and_adapter():
    tokens = list(range(8))
    plain = [h for h, _ in chain_keys(tokens, "", 4, 2)]
    other_adapter = [h for h, _ in chain_keys(tokens, "lora-a", 4, 2)]
    other_prefix = [h for h, _ in chain_keys([9, 9, 9, 9] + tokens[4:], "", 4, 2)]
    assert plain[0] != other_adapter[0] and plain[1] != other_adapter[1]
    assert plain[1] != other_prefix[1]          # same block tokens, different history
    resumed = [h for h, _ in chain_keys(tokens, "", 4, 2, first_block=1, parent=plain[0])]
    assert resumed == plain[1:]


def test_lookup_guards_against_hash_collisions():
    cache = PrefixCache(hash_fn=lambda key: 42)
    (h1, k1), = chain_keys([1, 2], "", 2, 1, hash_fn=cache.hash_fn)
    (h2, k2), = chain_keys([3, 4], "", 2, 1, hash_fn=cache.hash_fn)
    assert h1 == h2
    cache.insert(5, h1, k1)
    assert cache.lookup(h1, k1) == 5
    assert cache.lookup(h2, k2) is None and cache.collisions == 1
    cache.insert(6, h2, k2)                      # the colliding block stays uncached
    assert not cache.is_cached(6) and len(cache) == 1
    cache.evict(5)
    assert cache.lookup(h1, k1) is None and len(cache) == 0
    cache.check_invariants()


# -- measurement --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_measure_block_allocate_free_cost(capsys):
    pool = BlockPool(100_000, PrefixCache())
    n = 100_000
    start = time.perf_counter()
    blocks = [pool.allocate() for _ in range(n)]
    allocate_us = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    for block in blocks:
        pool.release(block)
    release_us = (time.perf_counter() - start) / n * 1e6
    with capsys.disabled():
        print(f"\n[block pool, 100k blocks] allocate {allocate_us:.3f} us/op, release {release_us:.3f} us/op")
    assert allocate_us < 50 and release_us < 50
