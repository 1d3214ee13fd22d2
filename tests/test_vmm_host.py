"""The host VMM driver against the real kernel: memfd pages, VMAs, resident memory, and SIGSEGV on unmapped pages."""
from __future__ import annotations

import gc
import mmap
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.flaky_memory import FlakyMemory, kernel_pages

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.accounting import AccountingVirtualMemory
from kvlab.vmm.drivers.host import POOL_NAME, HostVirtualMemory, max_map_count
from kvlab.vmm.drivers.types import TornMirror

KiB, MiB, GiB = 1024, 1024**2, 1024**3
ROOT = Path(__file__).resolve().parents[1]


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def vmas_in(base: int, nbytes: int) -> int:
    """Lines of /proc/self/maps that overlap [base, base + nbytes): the kernel's VMAs for that range."""
    count = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        count += lo < base + nbytes and hi > base
    return count


@pytest.fixture
def vm():
    driver = HostVirtualMemory(page_size=64 * KiB)
    yield driver
    driver.close()


def test_reserve_costs_no_resident_memory_and_mapping_does(vm):
    rss0, shmem0 = status_kib("VmRSS"), status_kib("RssShmem")
    region = vm.reserve(32 * GiB)
    assert region.nbytes == 32 * GiB
    assert status_kib("VmRSS") - rss0 < 8 * 1024          # 32 GiB reserved, < 8 MiB resident
    vm.create_store(256)
    assert os.fstat(vm.os.fd).st_blocks * 512 == 256 * vm.page_size   # the store's memory, allocated up front
    assert status_kib("RssShmem") - shmem0 < 1024         # but none of it is mapped yet
    view = vm.tensor_view(region, torch.uint8, (16 * MiB,))
    vm.map(region, 8 * GiB, 0, 256)                        # 16 MiB somewhere in the middle
    view_mid = vm.tensor_view(region, torch.uint8, (16 * MiB,), offset=8 * GiB)
    view_mid.fill_(7)
    grown = status_kib("RssShmem") - shmem0
    assert 15 * 1024 <= grown <= 20 * 1024, grown           # ~16 MiB: the mapped pages, not the reservation
    assert status_kib("VmRSS") - rss0 < 64 * 1024
    assert int(view_mid[::4096].sum()) == 7 * 4096
    del view, view_mid


def test_a_lazy_store_allocates_its_pages_on_first_map_only():
    vm = HostVirtualMemory(page_size=64 * KiB, populate=False)
    try:
        region = vm.reserve(4 * vm.page_size)
        vm.create_store(4)
        assert os.fstat(vm.os.fd).st_blocks == 0
        vm.map(region, 0, 1)
        vm.tensor_view(region, torch.uint8, (vm.page_size,)).fill_(1)
        assert os.fstat(vm.os.fd).st_blocks * 512 == vm.page_size
    finally:
        vm.close()


def test_a_grown_store_allocates_the_new_pages_and_a_regrown_one_zeroes_them(vm):
    region = vm.reserve(4 * vm.page_size)
    vm.create_store(2)
    vm.map(region, 0, 1)
    view = vm.tensor_view(region, torch.uint8, (vm.page_size,))
    view.fill_(9)
    vm.unmap(region, 0)
    vm.resize_store(1)                                             # page 1 punched out
    vm.resize_store(4)                                             # pages 1-3 allocated again
    assert os.fstat(vm.os.fd).st_blocks * 512 == 4 * vm.page_size
    vm.map(region, 0, 1)
    assert int(view.sum()) == 0
    del view


def test_memfd_pool_is_named_in_proc_maps(vm):
    region = vm.reserve(4 * vm.page_size)
    vm.create_store(4)
    vm.map(region, 0, 2, 1)
    maps = Path("/proc/self/maps").read_text()
    lines = [ln for ln in maps.splitlines() if f"memfd:{POOL_NAME}" in ln]
    assert lines, "the pool memfd is not mapped"
    lo = int(lines[0].split()[0].split("-")[0], 16)
    offset = int(lines[0].split()[2], 16)
    assert lo == region.base and offset == 2 * vm.page_size


def test_writes_through_the_view_land_in_the_pool_pages_mapped(vm):
    """Pool pages 5, 3, 7 at VA pages 0, 1, 2; read the pool back through independent paths."""
    page = vm.page_size
    region = vm.reserve(3 * page)
    vm.create_store(8)
    for va, pool in enumerate((5, 3, 7)):
        vm.map(region, va * page, pool)
    view = vm.tensor_view(region, torch.int32, (3, page // 4))
    view.copy_(torch.arange(3 * page // 4, dtype=torch.int32).reshape(3, -1))
    for va, pool in enumerate((5, 3, 7)):
        raw = os.pread(vm.os.fd, page, vm.os.page_offset(pool))           # syscall read of the memfd
        assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.int32), view[va])
    fd = os.open(f"/proc/self/fd/{vm.os.fd}", os.O_RDONLY)                # a second open file, a second mapping
    try:
        with mmap.mmap(fd, 8 * page, mmap.MAP_SHARED, mmap.PROT_READ) as second:
            assert torch.equal(torch.frombuffer(bytearray(second[3 * page:4 * page]), dtype=torch.int32), view[1])
    finally:
        os.close(fd)
    vm.unmap(region, page)
    vm.map(region, page, 6)                                            # a fresh pool page: reads as zeros
    assert int(view[1].abs().sum()) == 0 and int(view[2][0]) == 2 * page // 4
    del view


def test_discard_and_shrink_give_memory_back(vm):
    region = vm.reserve(8 * vm.page_size)
    vm.create_store(8)
    vm.map(region, 0, 0, 8)
    view = vm.tensor_view(region, torch.uint8, (8 * vm.page_size,))
    view.fill_(1)
    full = os.fstat(vm.os.fd).st_blocks * 512
    assert full >= 8 * vm.page_size
    vm.unmap(region, 0, 8)
    assert os.fstat(vm.os.fd).st_blocks * 512 == full                 # unmapped, but the pool keeps its pages
    vm.map(region, 0, 0, 2)
    with pytest.raises(DriverError, match="some are mapped"):
        vm.discard(0, 2)
    vm.unmap(region, 0, 2)
    vm.discard(0, 4)
    assert os.fstat(vm.os.fd).st_blocks * 512 == full - 4 * vm.page_size
    vm.resize_store(2)                                               # cut pages 2..7: punched as well
    assert os.fstat(vm.os.fd).st_blocks == 0
    assert vm.stats.discarded_pages == 4 + 6
    del view


def test_unmapped_pages_really_are_unmapped():
    """Reading an unmapped page kills the process with SIGSEGV, through a raw address and through the view."""
    script = textwrap.dedent("""
        import ctypes, sys, torch
        from kvlab.vmm.drivers.host import HostVirtualMemory
        vm = HostVirtualMemory(page_size=65536)
        region = vm.reserve(4 * 65536)
        vm.create_store(4)
        vm.map(region, 0, 0, 2)
        view = vm.tensor_view(region, torch.float32, (4, 16384))
        view[:2] = 1.0
        print("mapped ok", float(view[:2].sum()), flush=True)
        vm.unmap(region, 65536)
        if sys.argv[1] == "view":
            print(float(view[1].sum()), flush=True)      # just unmapped
        else:
            print(ctypes.string_at(region.base + 3 * 65536, 8), flush=True)   # never mapped
        print("survived", flush=True)
    """)
    for how in ("view", "raw"):
        proc = subprocess.run([sys.executable, "-c", script, how], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=False)
        assert "mapped ok 32768.0" in proc.stdout, proc.stderr
        assert "survived" not in proc.stdout
        assert proc.returncode == -11, (how, proc.returncode, proc.stderr[-500:])


@pytest.mark.parametrize("page_size", [4 * KiB, 64 * KiB])
def test_mapping_count_model_matches_the_kernel(page_size):
    """The driver's VMA count (merging neighbours with consecutive pool offsets, PROT_NONE gaps included)
    equals what /proc/self/maps shows, through random maps and unmaps."""
    vm = HostVirtualMemory(page_size=page_size)
    pages = 128
    region = vm.reserve(pages * page_size)
    vm.create_store(2 * pages)
    rng = random.Random(page_size)
    free = list(range(2 * pages))
    for _ in range(300):
        i = rng.randrange(pages)
        if i in region.mapped:
            run = next(k for k in range(1, pages - i + 1) if i + k not in region.mapped)
            n = rng.randint(1, run)
            free.extend(region.mapped[j] for j in range(i, i + n))
            vm.unmap(region, i * page_size, n)
        else:
            prev = region.mapped.get(i - 1)
            pool = prev + 1 if prev is not None and prev + 1 in free and rng.random() < 0.7 else rng.choice(free)
            free.remove(pool)
            vm.map(region, i * page_size, pool)
        assert region.segments == vmas_in(region.base, region.nbytes)
    assert vm.stats.num_mappings == region.segments
    vm.close()


def test_in_order_pages_merge_into_one_mapping(vm):
    region = vm.reserve(64 * vm.page_size)
    vm.create_store(128)
    for i in range(64):
        vm.map(region, i * vm.page_size, 10 + i)
    assert region.segments == 1 == vmas_in(region.base, region.nbytes)
    vm.unmap(region, 20 * vm.page_size)                 # a hole splits it: mapped, PROT_NONE, mapped
    assert region.segments == 3 == vmas_in(region.base, region.nbytes)
    vm.map(region, 20 * vm.page_size, 100)              # not the next pool page: still three
    assert region.segments == 3 == vmas_in(region.base, region.nbytes)


def test_mapping_limit_refuses_before_the_kernel_does():
    assert max_map_count() > 1000
    vm = HostVirtualMemory(page_size=4 * KiB, mapping_limit=20)
    region = vm.reserve(64 * vm.page_size)
    vm.create_store(64)
    with pytest.raises(DriverError, match=r"vm\.max_map_count.*page_size"):
        for i in range(0, 64, 2):                         # scattered: every page is 2 VMAs
            vm.map(region, i * vm.page_size, 63 - i)
    assert vm.stats.num_mappings <= 20
    assert region.segments == vmas_in(region.base, region.nbytes)   # the refused map changed nothing
    vm.map(region, (2 * len(region.mapped) - 1) * vm.page_size, 64 - 2 * len(region.mapped) + 2)
    assert region.segments == vmas_in(region.base, region.nbytes)   # a merging neighbour is still allowed
    vm.close()


def test_misuse_raises_driver_errors(vm):
    region = vm.reserve(vm.page_size * 4)
    vm.create_store(4)
    vm.map(region, 0, 0)
    with pytest.raises(DriverError, match="already mapped"):
        vm.map(region, 0, 1)
    with pytest.raises(DriverError, match="not mapped"):
        vm.unmap(region, vm.page_size)
    with pytest.raises(DriverError, match="page-aligned"):
        vm.map(region, 100, 1)
    with pytest.raises(DriverError, match="outside the page store"):
        vm.map(region, vm.page_size, 4)
    with pytest.raises(DriverError, match="still mapped"):
        vm.resize_store(0)
    with pytest.raises(DriverError, match="multiple of the OS page"):
        HostVirtualMemory(page_size=1000)


def test_release_refuses_and_close_defers_while_views_live():
    vm = HostVirtualMemory(page_size=64 * KiB)
    region = vm.reserve(vm.page_size)
    vm.create_store(1)
    vm.map(region, 0, 0)
    view = vm.tensor_view(region, torch.float32, (4, 4))
    row = view[1]                                        # a view of the view keeps the memory alive too
    del view
    with pytest.raises(DriverError, match="still alive"):
        vm.release(region)
    vm.close()                                           # completes: the viewed range waits for its last view
    assert vm.closed and vm.stats.deferred_releases == 1
    row.fill_(1.0)                                       # still mapped: nothing was pulled from under the view
    assert _pool_mappings() > 0
    del row
    gc.collect()
    assert _pool_mappings() == 0 and not vm.regions and vm.stats.num_mappings == 0
    vm.close()                                           # idempotent
    with pytest.raises(DriverError, match="closed"):
        vm.reserve(1)


def _pool_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(POOL_NAME in line for line in f)


def test_tensor_view_is_zero_copy(vm):
    region = vm.reserve(16 * GiB)                        # a copying API would need 16 GiB here
    view = vm.tensor_view(region, torch.bfloat16, (1024, 8 * MiB))
    assert view.data_ptr() == region.base
    strided = vm.tensor_view(region, torch.float32, (4, 10, 2), strides=(vm.page_size // 4, 2, 1),
                             offset=vm.page_size)
    assert strided.data_ptr() == region.base + vm.page_size and strided.stride() == (vm.page_size // 4, 2, 1)
    with pytest.raises(DriverError, match="does not fit"):
        vm.tensor_view(region, torch.float32, (region.nbytes // 4 + 1,))
    del view, strided


def test_accounting_driver_counts_like_the_host(vm):
    """The simulator's driver keeps the same books: identical mapping counts for the same calls."""
    acct = AccountingVirtualMemory(vm.page_size)
    rng = random.Random(1)
    regions = [d.reserve(32 * vm.page_size) for d in (vm, acct)]
    for d in (vm, acct):
        d.create_store(64)
    for _ in range(100):
        i, pool = rng.randrange(32), rng.randrange(64)
        for d, r in zip((vm, acct), regions):
            if i in r.mapped:
                d.unmap(r, i * vm.page_size)
            elif pool not in {p for p in r.mapped.values()}:
                d.map(r, i * vm.page_size, pool)
        assert vm.stats.num_mappings == acct.stats.num_mappings
        assert vm.stats.mapped_pages == acct.stats.mapped_pages
    with pytest.raises(DriverError, match="no memory"):
        acct.tensor_view(regions[1], torch.float32, (4,))


def test_a_driver_dropped_without_close_frees_its_memory_but_never_under_a_live_view():
    import gc

    def kvlab_mappings() -> int:
        return Path("/proc/self/maps").read_text().count(f"memfd:{POOL_NAME}")
    fds = len(os.listdir("/proc/self/fd"))
    before = kvlab_mappings()
    kept = None
    for i in range(3):
        vm = HostVirtualMemory(page_size=64 * KiB)
        region = vm.reserve(GiB)
        vm.create_store(2)
        vm.map(region, 0, 0)
        view = vm.tensor_view(region, torch.float32, (16,))
        kept = view if i == 0 else kept
        del vm, view, region
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds                  # every memfd closed
    assert kvlab_mappings() == before + 1                             # only the range a view still uses
    kept.fill_(2.0)
    assert float(kept.sum()) == 32.0
    del kept
    gc.collect()
    assert kvlab_mappings() == before


# -- failed OS calls: the books keep saying what the kernel maps ------------------------------------------------
def three_places(vm: HostVirtualMemory, pages: int = 4):
    spots = [(vm.reserve(pages * vm.page_size), 0) for _ in range(3)]
    vm.create_store(3 * pages)
    return spots, vm.mirror(spots, pages * vm.page_size, pages)


def assert_books_are_the_kernels(vm, spots) -> None:
    for region, _ in spots:
        assert region.mapped == kernel_pages(region, vm.page_size)
        assert region.segments == vmas_in(region.base, region.nbytes)
    assert vm.stats.mapped_pages == sum(len(r.mapped) for r, _ in spots) == sum(vm.store_maps)


def test_a_mirrored_unmap_failing_in_a_later_place_maps_the_earlier_ones_back():
    vm = HostVirtualMemory(memory=FlakyMemory(64 * KiB))
    spots, mirror = three_places(vm)
    vm.map_mirrored(mirror, 0, 1, 2)
    views = [vm.tensor_view(region, torch.int32, (2, vm.page_size // 4)) for region, _ in spots]
    for t, view in enumerate(views):
        view.fill_(t + 1)
    before = [dict(region.mapped) for region, _ in spots]
    vm.os.fail_next("unmap", 2)                                  # the third place refuses
    with pytest.raises(DriverError, match="injected unmap failure"):
        vm.unmap_mirrored(mirror, 0, 2)
    assert [region.mapped for region, _ in spots] == before
    assert_books_are_the_kernels(vm, spots)
    assert [int(v.sum()) for v in views] == [(t + 1) * vm.page_size // 2 for t in range(3)]   # data kept
    del views, view
    vm.unmap_mirrored(mirror, 0, 2)
    assert_books_are_the_kernels(vm, spots)
    vm.close()


def test_a_mirrored_map_failing_in_a_later_place_unmaps_the_earlier_ones():
    vm = HostVirtualMemory(memory=FlakyMemory(64 * KiB))
    spots, mirror = three_places(vm)
    vm.os.fail_next("map", 1)
    with pytest.raises(DriverError, match="injected map failure"):
        vm.map_mirrored(mirror, vm.page_size, 0, 3)
    assert all(region.mapped == {} for region, _ in spots)
    assert_books_are_the_kernels(vm, spots)
    vm.map_mirrored(mirror, vm.page_size, 0, 3)
    assert_books_are_the_kernels(vm, spots)
    vm.close()


def test_when_the_undo_fails_too_the_places_are_torn_and_the_books_exact():
    vm = HostVirtualMemory(memory=FlakyMemory(64 * KiB))
    spots, mirror = three_places(vm)
    vm.map_mirrored(mirror, 0, 0, 2)
    vm.os.fail_next("unmap", 1)                                  # place 1 refuses ...
    vm.os.fail_next("map", 0)                                    # ... and mapping place 0 back fails
    with pytest.raises(TornMirror, match="undoing it failed too"):
        vm.unmap_mirrored(mirror, 0, 2)
    assert [len(region.mapped) for region, _ in spots] == [0, 2, 2]
    assert_books_are_the_kernels(vm, spots)
    with pytest.raises(DriverError, match="not mapped"):      # the strict call refuses a torn range ...
        vm.unmap_mirrored(mirror, 0, 2)
    vm.clear_mirrored(mirror, 0, 2)                           # ... clearing unmaps what is left
    assert_books_are_the_kernels(vm, spots)
    assert vm.stats.mapped_pages == 0
    vm.close()


def test_release_and_close_go_on_past_failed_unmaps():
    vm = HostVirtualMemory(memory=FlakyMemory(64 * KiB))
    a, b = vm.reserve(4 * vm.page_size), vm.reserve(2 * vm.page_size)
    vm.create_store(8)
    vm.map(a, 0, 0)
    vm.map(a, 2 * vm.page_size, 5, 2)
    vm.map(b, 0, 1, 2)
    vm.os.fail_next("unmap", 0)                                  # once: the retry, page by page, succeeds
    with pytest.raises(DriverError, match=r"closing .* 1 driver call\(s\) failed \(injected unmap failure\); every "
                                          "range was released in the end"):
        vm.close()
    assert vm.stats.release_retries == 1 and vm.stats.mapped_pages == 0 and vm.stats.reserved_bytes == 0
    assert kernel_pages(a, vm.page_size) == {} and kernel_pages(b, vm.page_size) == {}

    vm = HostVirtualMemory(memory=FlakyMemory(64 * KiB))   # every unmap fails: munmap frees the range anyway
    region = vm.reserve(4 * vm.page_size)
    vm.create_store(4)
    vm.map(region, 0, 0, 2)
    vm.map(region, 3 * vm.page_size, 3)
    vm.os.fail_next("unmap", *range(10))
    with pytest.raises(DriverError, match=r"5 driver call\(s\) failed .* the range was released in the end"):
        vm.release(region)
    assert region.released and region.mapped == {} and kernel_pages(region, vm.page_size) == {}
    assert vm.stats.mapped_pages == 0 == sum(vm.store_maps) and vm.stats.num_mappings == 0
    vm.close()


def cow_cache(driver: HostVirtualMemory):
    """A real-mode vmm cache (host memory) with a 20-token parent forked into a child: page 1 is shared."""
    from kvlab.common.config import make_config
    from kvlab.common.kv.types import KVShape
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.build import build_vmm
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, num_q_heads=4)      # 16 tokens per 4 KiB page
    cache = build_vmm(make_config(backend="vmm", page_size=4096, kv_cache_bytes=8 * 4 * 4096, max_model_len=64,
                                   max_num_seqs=4), shape, driver=driver)
    parent = Sequence(0, "a", list(range(20)), 8)
    cache.allocator.allocate(parent, 20)
    parent.num_computed_tokens = 20
    for t, kv in enumerate(cache.storage.views.k + cache.storage.views.v):
        kv[cache.allocator.snapshot()["slot_of"][0], :20] = t + 1.0
    child = Sequence(1, "c", list(range(20)), 8)
    child.num_computed_tokens = 20
    cache.allocator.fork(parent, child)
    child.append_token(7)
    return cache, child


def child_kv(cache) -> list[float]:
    slot = cache.allocator.snapshot()["slot_of"][1]
    return [float(kv[slot, :20].mean()) for kv in cache.storage.views.k + cache.storage.views.v]


def test_a_failed_copy_on_write_keeps_the_shared_page_its_data_and_the_pool():
    """Reported: an unmap failing in tensor 1 during copy-on-write lost the group taken from the pool and left
    tensor 0 unmapped while the slot still listed the page."""
    driver = HostVirtualMemory(memory=FlakyMemory(4096))
    cache, child = cow_cache(driver)
    free = cache.allocator.num_free_units()
    driver.os.fail_next("unmap", 1)
    with pytest.raises(DriverError, match="injected unmap failure"):
        cache.allocator.allocate(child, 21)                             # writes into the shared page 1: copy-on-write
    assert cache.allocator.num_free_units() == free and cache.stats().cow_copies == 0
    cache.check_invariants()                                  # the pool, the slots and every tensor agree
    assert child_kv(cache) == [1.0, 2.0, 3.0, 4.0]            # still reads the parent's page
    cache.allocator.allocate(child, 21)                                 # and the copy works once the OS does
    assert cache.stats().cow_copies == 1 and child_kv(cache) == [1.0, 2.0, 3.0, 4.0]
    cache.check_invariants()
    cache.close()


def test_a_copy_on_write_whose_undo_fails_is_reported_torn_and_freeing_clears_it():
    driver = HostVirtualMemory(memory=FlakyMemory(4096))
    cache, child = cow_cache(driver)
    driver.os.fail_next("unmap", 1)
    driver.os.fail_next("map", 0)                                # mapping tensor 0 back fails as well
    with pytest.raises(TornMirror, match="close the cache"):
        cache.allocator.allocate(child, 21)
    with pytest.raises(AssertionError, match="tensor 0 is not mapped"):
        cache.check_invariants()                              # a kernel never runs on it
    assert cache.stats().extra["torn_pages"] == 1
    for region, _ in cache.allocator.ranges.places:
        assert region.mapped == kernel_pages(region, 4096)
    cache.allocator.free(child)                                         # its torn page is cleared, not parked
    cache.check_invariants()
    assert cache.stats().extra["torn_pages"] == 0
    cache.close()
