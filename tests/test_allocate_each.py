"""Allocator.allocate_each, the scheduler's one call a step for its running sequences, does exactly what `allocate`
for each sequence in turn does: the same count (stopping at the first sequence that finds no room), the same books
and the same stats, on every backend, with and without the decode path that vmm and paged take in one loop, and
with vmm's background mapping (its loop stops at slots with a job and asks for pages ahead as `allocate` does)."""
from __future__ import annotations

import random
from concurrent.futures import wait

import pytest
from helpers.invariants import PAGE, SHAPE

from kvlab.common.config import make_config
from kvlab.common.kv.seam import Allocator, create_cache
from kvlab.common.sequence import Sequence

BACKENDS = ("paged", "vmm", "reserve", "elastic")
# every backend plain, each with a prefix cache with one (reserve has none), and vmm mapping in the background
CASES = [(b, False) for b in BACKENDS] + [(b, True) for b in BACKENDS if b != "reserve"] + [("vmm-background", False)]
MAX_LEN = 256


def allocator(backend: str, **extra) -> Allocator:
    if backend == "vmm-background":
        backend, extra["background_mapping"] = "vmm", True
    config = make_config(backend=backend, block_size=16, page_size=PAGE, elastic_block_size=16,
                         kv_cache_bytes=40 * 16 * SHAPE.bytes_per_token, max_num_seqs=8, max_model_len=MAX_LEN,
                         **extra)
    return create_cache(config, SHAPE, accounting_only=True).allocator


def one_at_a_time(cache: Allocator, seqs: list[Sequence], targets: list[int]) -> int:
    for i, seq in enumerate(seqs):
        if cache.allocate(seq, targets[i]) is None:
            return i
    return len(seqs)


def grow(cache: Allocator, live: list[Sequence], plan: list[int], take) -> int:
    """One step: each live sequence asks for plan[i] more tokens; the ones granted have computed them; the first
    refused (if any) is freed, as a preemption would. The background mapper's jobs of the step run to their end
    before the next (as if the forward pass ran), so both caches' books are compared at the same point."""
    targets = [seq.num_computed_tokens + n for seq, n in zip(live, plan)]
    done = take(cache, live, targets)
    settle(cache)
    for seq, target in zip(live[:done], targets):
        seq.token_ids += [7] * (target - seq.num_tokens)
        seq.num_computed_tokens = target
    if done < len(live):
        cache.free(live.pop(done))
    return done


def settle(cache: Allocator) -> None:
    """Launch the step's map-ahead jobs and wait for them; their slots stay to be fenced by the next step's calls
    (as after a forward pass)."""
    mapper = getattr(cache, "mapper", None)
    if mapper is not None and mapper.enabled:
        mapper.launch()
        wait(list(mapper.pending.values()))


@pytest.mark.parametrize(("backend", "prefix"), CASES,
                         ids=[f"{b}-{'prefix-caching' if p else 'plain'}" for b, p in CASES])
def test_allocate_each_is_allocate_for_each_in_turn(backend, prefix):
    rng = random.Random(backend)
    each, single = allocator(backend, enable_prefix_caching=prefix), allocator(backend, enable_prefix_caching=prefix)
    twins: list[tuple[Sequence, Sequence]] = []
    refused = next_id = busy = 0
    for _ in range(300):
        while len(twins) < 6:
            prompt = [rng.randint(3, 9) for _ in range(rng.randint(1, 40))]
            pair = (Sequence(next_id, str(next_id), prompt, MAX_LEN), Sequence(next_id, str(next_id), prompt, MAX_LEN))
            next_id += 1
            if each.allocate(pair[0], len(prompt)) is None:
                assert single.allocate(pair[1], len(prompt)) is None
                break
            assert single.allocate(pair[1], len(prompt)) is not None
            for seq in pair:
                seq.num_computed_tokens = len(prompt)
            twins.append(pair)
        plan = [rng.choice([1, 1, 1, 1, 1, 1, 3, 16]) if seq.num_computed_tokens < MAX_LEN - 16 else 0
                for seq, _ in twins]
        live_each, live_single = [a for a, _ in twins], [b for _, b in twins]
        done = grow(each, live_each, plan, Allocator.allocate_each)
        assert grow(single, live_single, plan, one_at_a_time) == done
        refused += done < len(twins)
        busy += bool(getattr(each, "mapper", None) and each.mapper.pending)
        twins = [pair for pair in twins if pair[0] in live_each]
        for seq, _ in twins[:1]:
            if seq.num_computed_tokens >= MAX_LEN - 16:      # make room for new ones now and then
                each.free(twins[0][0])
                single.free(twins[0][1])
                twins.pop(0)
        assert each.snapshot() == single.snapshot()
        assert each.stats().live_tokens == single.stats().live_tokens
        each.check_invariants()
    # reserve holds max_model_len from admission on, so its growth never finds no room
    assert refused or backend == "reserve", "the budget never ran out: the stop at a refusal went untested"
    if backend == "vmm-background":   # jobs mapped ahead, and the loop met slots whose job was still to be fenced
        assert each.stats().extra["lookahead_pages"] > 0 and busy


def test_allocate_each_stops_at_the_first_refusal_and_changes_nothing_after_it():
    cache = allocator("paged")
    seqs = [Sequence(i, str(i), [5] * 16, MAX_LEN) for i in range(3)]
    assert cache.allocate_each(seqs, [16, 16, 16]) == 3
    for seq in seqs:
        seq.num_computed_tokens = 16
    free = cache.num_free_units()
    assert cache.allocate_each(seqs, [17, 16 * (free + 3), 17]) == 1     # the second asks for more than is left
    assert cache.num_free_units() == free - 1 and not cache.units_needed(seqs[0], 17)
    assert cache.units_needed(seqs[2], 17) == 1                            # the third was never asked


def test_a_background_job_error_reaches_the_step_that_next_grows_its_slot():
    """The one-loop decode path stops at a slot whose job is not fenced yet, so `allocate` fences it and a job's
    error is raised there, as one allocate at a time would."""
    cache = allocator("vmm-background")
    seqs = [Sequence(i, str(i), [5] * 14, MAX_LEN) for i in range(2)]
    for seq in seqs:
        assert cache.allocate(seq, 14) == 0
        seq.num_computed_tokens = 14

    def broken(index: int, seq_id: int, target: int) -> bool:
        raise RuntimeError(f"map-ahead failed for slot {index}")
    cache.mapper._map_ahead = broken
    assert cache.allocate_each(seqs, [15, 15]) == 2     # 15 of 16 tokens: both ask for their next page
    settle(cache)
    with pytest.raises(RuntimeError, match="map-ahead failed"):
        cache.allocate_each(seqs, [16, 16])


def test_reserve_allocate_each_refuses_a_target_past_the_region_as_allocate_does():
    """The oracle reserve sizes a region to the sequence's final length; a region never grows, so a target past it
    is refused by the one-loop path exactly as by `allocate` (nothing changed, the sequences after it not asked)."""
    cache = allocator("reserve", reserve_mode="oracle")
    seqs = [Sequence(i, str(i), [5] * 8, 4) for i in range(3)]          # regions of 12 tokens each
    assert cache.allocate_each(seqs, [8, 8, 8]) == 3
    for seq in seqs:
        seq.num_computed_tokens = 8
    live = cache.stats().live_tokens
    assert cache.allocate_each(seqs, [12, 13, 9]) == 1                      # the second asks past its region
    assert cache.allocate(seqs[1], 13) is None
    assert cache.stats().live_tokens == live + 4
    cache.check_invariants()
