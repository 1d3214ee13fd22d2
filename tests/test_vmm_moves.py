"""vmm growth books its page moves first and hands the driver side to the memory room in one batch (vmm/pages.py,
vmm/page_calls.py, `VirtualMemory.apply`). These tests fail an OS call at each point of a growth that reclaims
parked pages from two freed slots and maps new runs, and check that the books are put back to exactly what the
kernel maps; and that the walk from `allocate` visits the allocator, the pages and the memory once each."""
from __future__ import annotations

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
