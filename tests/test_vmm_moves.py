"""vmm growth books its page moves first and hands the driver side to the memory room in one batch (vmm/pages.py,
vmm/page_calls.py, `VirtualMemory.apply`). These tests fail an OS call at each point of a growth that reclaims
parked pages from two freed slots and maps new runs, and check that the books are put back to exactly what the
kernel maps; and that the walk from `allocate` visits the allocator, the pages and the memory once each."""
from __future__ import annotations

from concurrent.futures import wait

import pytest
from helpers.flaky_memory import FlakyMemory, kernel_pages
from helpers.vmm_walk import returns, walks

from kvlab.common.config import make_config
from kvlab.common.errors import DriverError
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.vmm.build import build_vmm
from kvlab.vmm.drivers.host import HostVirtualMemory
from kvlab.vmm.drivers.types import TornMirror

PAGE = 4096
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, num_q_heads=4)   # 16 tokens a page, 4 tensors
TPP = 16


def reclaiming_growth(memory: FlakyMemory):
    """Six page groups: a and b (one page each) freed and parked, d holding two, c one, one group free. Growing c
    to 4 pages then takes the free group and reclaims a's page, then b's (oldest freed first)."""
    config = make_config(backend="vmm", page_size=PAGE, kv_cache_bytes=6 * 4 * PAGE, max_model_len=4 * TPP,
                         max_num_seqs=4, max_num_batched_tokens=256)
    cache = build_vmm(config, SHAPE, driver=HostVirtualMemory(memory=memory))
    alloc = cache.allocator
    a, b, c, d = (Sequence(i, str(i), list(range(n)), 8) for i, n in enumerate((TPP, TPP, TPP, 2 * TPP)))
    for seq, n in ((a, TPP), (c, TPP), (b, TPP), (d, 2 * TPP)):
        alloc.allocate(seq, n)
    alloc.free(a)
    alloc.free(b)
    c.num_computed_tokens = TPP
    return cache, c


def growth_calls() -> dict[str, int]:
    """The OS calls growing c makes on a clean run."""
    memory = FlakyMemory(PAGE)
    cache, c = reclaiming_growth(memory)
    before = dict(memory.calls)
    cache.allocator.allocate(c, 4 * TPP)
    calls = {k: memory.calls[k] - before[k] for k in before}
    stats = cache.stats()
    assert stats.extra["reclaimed_units"] == 2 and len(cache.allocator.table.stale) == 0
    cache.check_invariants()
    cache.close()
    return calls


CALLS = growth_calls()
POINTS = [(call, n) for call, count in CALLS.items() for n in range(count)]


def test_the_growth_unmaps_two_parked_pages_and_maps_the_new_runs():
    assert CALLS["unmap"] == 2 * 4            # a's page, then b's, in each of the 4 tensors
    assert CALLS["map"] >= 4                   # at least one run of the three new groups, in each tensor


def assert_books_are_the_kernels(cache) -> None:
    cache.check_invariants()                   # slots, free list, reclaimable count and the driver's books agree
    for region, _ in cache.allocator.ranges.places:
        assert region.mapped == kernel_pages(region, PAGE)


@pytest.mark.parametrize(("call", "n"), POINTS, ids=[f"{c}{n}" for c, n in POINTS])
def test_a_failed_call_leaves_the_books_as_the_kernel_maps_and_the_growth_works_after(call, n):
    memory = FlakyMemory(PAGE)
    cache, c = reclaiming_growth(memory)
    alloc = cache.allocator
    free, held, stale = alloc.num_free_units(), alloc.table.of(c.seq_id).held, list(alloc.table.stale)
    memory.fail_next(call, n)
    with pytest.raises(DriverError, match=f"injected {call} failure"):
        alloc.allocate(c, 4 * TPP)
    assert_books_are_the_kernels(cache)
    assert alloc.num_free_units() == free and alloc.table.of(c.seq_id).held == held
    reclaimed = cache.stats().extra["reclaimed_units"]
    assert list(alloc.table.stale) == stale[reclaimed:]            # what was not unmapped is parked as before
    alloc.allocate(c, 4 * TPP)
    assert_books_are_the_kernels(cache)
    assert cache.stats().extra["reclaimed_units"] == 2
    cache.close()


def test_a_failed_map_whose_undo_fails_too_is_torn_and_freeing_clears_it():
    memory = FlakyMemory(PAGE)
    cache, c = reclaiming_growth(memory)
    memory.fail_next("map", CALLS["map"] - 1)   # the last run's last tensor ...
    memory.fail_next("unmap", CALLS["unmap"])    # ... and unmapping that run's first tensor back
    with pytest.raises(TornMirror):
        cache.allocator.allocate(c, 4 * TPP)
    assert cache.stats().extra["torn_pages"] > 0
    with pytest.raises(AssertionError, match="is not mapped"):
        cache.check_invariants()
    cache.allocator.free(c)                     # its torn pages are cleared, not parked
    assert cache.stats().extra["torn_pages"] == 0
    assert_books_are_the_kernels(cache)
    cache.close()


def test_a_failed_map_ahead_keeps_what_it_reclaimed_free():
    """The background mapper's job (run inline here): parked pages reclaimed, then the map refused."""
    memory = FlakyMemory(PAGE)
    cache, c = reclaiming_growth(memory)
    alloc = cache.allocator
    slot = alloc.table.of(c.seq_id)
    memory.fail_next("map", 0)
    with pytest.raises(DriverError, match="injected map failure"):
        alloc.pages.map_ahead(slot.index, c.seq_id, 4)
    assert_books_are_the_kernels(cache)
    assert len(slot.groups) == 1
    cache.close()


def test_the_walk_from_allocate_never_returns_to_a_room_it_left():
    """Issue 35's walk (tests/helpers/vmm_walk.py): the allocator decides, the pages book, the memory maps."""
    found = walks()
    assert found["admission"] == found["decode, new page"] == ["allocator", "pages", "memory"]
    assert found["decode, same page"] == ["allocator", "pages"]
    assert all(returns(stays) == 0 for stays in found.values())


# -- background mapping: the unmaps of reclaimed pages are put off to the mapper's next job ---------------------------
def put_off_growth(memory: FlakyMemory):
    """`reclaiming_growth` with background mapping on; no sequence is near its next page, so no map-ahead job is
    wanted."""
    config = make_config(backend="vmm", page_size=PAGE, kv_cache_bytes=6 * 4 * PAGE, max_model_len=4 * TPP,
                         max_num_seqs=4, max_num_batched_tokens=256, background_mapping=True)
    cache = build_vmm(config, SHAPE, driver=HostVirtualMemory(memory=memory))
    alloc = cache.allocator
    half = TPP // 2
    a, b, c, d = (Sequence(i, str(i), list(range(n)), 8) for i, n in enumerate((half, half, half, 2 * TPP - 4)))
    for seq in (a, c, b, d):
        alloc.allocate(seq, seq.num_tokens)
    alloc.free(a)
    alloc.free(b)
    c.num_computed_tokens = half
    assert not alloc.mapper.wanted
    return cache, c


def run_put_off(cache) -> None:
    """What a step's rows() does before the forward pass: launch the mapper's jobs; then wait for them."""
    alloc = cache.allocator
    alloc.rows([], check=False)
    mapper = alloc.mapper
    wait([*mapper.pending.values(), *([mapper.unmapping] if mapper.unmapping is not None else [])])
    mapper.fence([])                                              # a job's error is raised here, as in a step


def assert_the_next_job_runs_the_put_off_unmaps(cache) -> None:
    assert_books_are_the_kernels(cache)                            # the put-off places are counted
    run_put_off(cache)
    assert cache.allocator.snapshot()["put_off"] == []
    assert_books_are_the_kernels(cache)


def grown_with_put_off(memory: FlakyMemory):
    """`put_off_growth` after c's growth: a's and b's old places wait for the mapper."""
    cache, c = put_off_growth(memory)
    cache.allocator.allocate(c, 4 * TPP)
    return cache, c


def test_with_background_mapping_a_growth_maps_now_and_its_unmaps_run_with_the_next_job():
    memory = FlakyMemory(PAGE)
    cache, c = put_off_growth(memory)
    alloc = cache.allocator
    unmaps = memory.calls["unmap"]
    alloc.allocate(c, 4 * TPP)
    assert memory.calls["unmap"] == unmaps                        # nothing unmapped on the step
    assert sorted(map(tuple, alloc.snapshot()["put_off"])) == [(0, 0, 1), (2, 0, 1)]   # a's page, then b's
    assert_books_are_the_kernels(cache)                            # the old places still map the pages: counted
    run_put_off(cache)
    assert memory.calls["unmap"] == unmaps + 2 * 4 and alloc.snapshot()["put_off"] == []
    assert_books_are_the_kernels(cache)
    cache.close()


def test_an_admission_beside_rows_with_unmaps_put_off_keeps_the_books_and_the_next_job_runs_them():
    """c ends and a new sequence takes its parked row before the mapper ran: the put-off places (a's and b's old
    rows) are still counted, and the next job unmaps them."""
    cache, c = grown_with_put_off(FlakyMemory(PAGE))
    alloc = cache.allocator
    alloc.free(c)                                                 # c's 4 pages park in its row
    e = Sequence(9, "9", list(range(3 * TPP)), 8)
    assert alloc.allocate(e, 3 * TPP) == 0 and alloc.table.of(e.seq_id).index == 1
    assert alloc.snapshot()["put_off"]
    assert_the_next_job_runs_the_put_off_unmaps(cache)
    cache.close()


def test_a_put_off_unmap_that_fails_is_raised_at_the_next_step_and_stays_put_off():
    memory = FlakyMemory(PAGE)
    cache, _ = grown_with_put_off(memory)
    memory.fail_next("unmap", 4)                                  # b's page, first tensor (a's went first)
    with pytest.raises(DriverError, match="injected unmap failure"):
        run_put_off(cache)
    assert [tuple(s) for s in cache.allocator.snapshot()["put_off"]] == [(2, 0, 1)]
    assert_the_next_job_runs_the_put_off_unmaps(cache)            # the OS works again
    cache.close()


def test_a_fork_into_a_row_with_unmaps_put_off_runs_them_first():
    cache, c = grown_with_put_off(FlakyMemory(PAGE))
    c.num_computed_tokens = 4 * TPP
    child = Sequence(7, "7", list(range(4 * TPP)), 8)
    cache.allocator.fork(c, child)                                # the child's row is a's old one: flushed first
    assert cache.allocator.snapshot()["slot_of"][child.seq_id] in (0, 2)
    assert_books_are_the_kernels(cache)
    cache.close()


def ahead_reclaimed(memory: FlakyMemory):
    """x maps its third page ahead (the mapper's job); y's admission reclaims it, putting its unmap off (x's row,
    page 2); y ends, its two pages parked. Returns the cache and x, all of its tokens computed."""
    config = make_config(backend="vmm", page_size=PAGE, kv_cache_bytes=7 * 4 * PAGE, max_model_len=4 * TPP,
                         max_num_seqs=4, max_num_batched_tokens=256, background_mapping=True)
    cache = build_vmm(config, SHAPE, driver=HostVirtualMemory(memory=memory))
    alloc = cache.allocator
    x, z, y = (Sequence(i, str(i), list(range(n)), 8) for i, n in enumerate((2 * TPP - 1, 3 * TPP - 4, TPP + 4)))
    for seq in (x, z):
        alloc.allocate(seq, seq.num_tokens)
    run_put_off(cache)
    assert len(alloc.table.of(x.seq_id).groups) == 3
    alloc.allocate(y, y.num_tokens)                               # the last free group and x's page ahead
    assert [tuple(s) for s in alloc.snapshot()["put_off"]] == [(0, 2, 1)]
    alloc.free(y)
    x.num_computed_tokens = x.num_tokens
    return cache, x


def test_a_live_row_whose_page_mapped_ahead_was_reclaimed_runs_the_put_off_unmap_before_it_grows():
    """x grows into that page again: its row's put-off unmap runs first (else the new map would land on a mapped
    page)."""
    cache, x = ahead_reclaimed(FlakyMemory(PAGE))
    cache.allocator.allocate(x, 2 * TPP + 1)                      # reclaims a page y parked
    assert_the_next_job_runs_the_put_off_unmaps(cache)
    cache.close()


def test_a_map_ahead_into_a_row_with_an_unmap_put_off_runs_it_first():
    """As above, but x's next page comes from the mapper: its job (launched by x's own next allocate) runs the
    row's put-off unmap before it maps."""
    cache, x = ahead_reclaimed(FlakyMemory(PAGE))
    alloc = cache.allocator
    alloc.allocate(x, 2 * TPP)                                    # within its pages, near the next: a job is wanted
    assert alloc.table.of(x.seq_id).index in alloc.mapper.wanted
    alloc.allocate(x, 2 * TPP)                                    # fences x's job: it runs now, on the worker
    assert len(alloc.table.of(x.seq_id).groups) == 3
    assert_books_are_the_kernels(cache)
    cache.close()


def test_the_os_calls_are_counted_by_what_made_them():
    """The counters `kvlab bench` reports (admit / grow / mapper): each is the OS calls the kernel saw while that part
    ran: first allocations and growths on the step, the mapper's map-ahead and put-off unmaps."""
    memory = FlakyMemory(PAGE)
    cache, c = put_off_growth(memory)
    alloc, counters = cache.allocator, cache.allocator.pages.counters
    made = lambda: memory.calls["map"] + memory.calls["unmap"]
    assert counters.admission_calls == made() > 0 and counters.growth_calls == alloc.mapper.calls == 0
    d = Sequence(3, "3", list(range(2 * TPP - 4)), 8)             # put_off_growth's d, 2 tokens from its third page
    d.num_computed_tokens = d.num_tokens
    assert alloc.allocate(d, 2 * TPP - 1) == 0 and alloc.mapper.wanted
    before = made()
    run_put_off(cache)                                             # the job maps d's next page from the free list
    assert alloc.mapper.calls == made() - before == 4 and counters.lookahead_pages == 1
    before = made()
    alloc.allocate(c, 4 * TPP)                                     # maps on the step; the unmaps are put off
    assert counters.growth_calls == made() - before > 0
    before, mapper = made(), alloc.mapper.calls
    run_put_off(cache)
    assert alloc.mapper.calls - mapper == made() - before > 0 and alloc.snapshot()["put_off"] == []
    assert counters.admission_calls + counters.growth_calls + alloc.mapper.calls == made()
    cache.close()
