"""The CUDA VMM driver against a recording fake of cuda.bindings.driver (and the real module, which has no GPU here)."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
from fakes.fake_cuda import (
    INVALID_CONTEXT,
    INVALID_VALUE,
    NOT_INITIALIZED,
    OK,
    OUT_OF_MEMORY,
    FakeCudaDriver,
    torch_interop,
)

from kvlab.common.config import make_config
from kvlab.common.errors import DriverError
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.vmm.build import build_vmm
from kvlab.vmm.drivers.cuda import CudaVirtualMemory

MiB = 1024**2
GRAN = 2 * MiB


@pytest.fixture
def fake():
    return FakeCudaDriver(granularity=GRAN)


@pytest.fixture
def vm(fake):
    driver = CudaVirtualMemory(0, driver=fake)
    yield driver
    if not driver.closed:
        driver.close()
    assert fake.leaks() == {}


def index(names: list[str], name: str) -> int:
    return names.index(name)


# -- the fake itself enforces the documented rules ------------------------------------------------------------
def test_fake_enforces_the_driver_rules(fake):
    drv = fake
    assert drv.cuMemAddressReserve(GRAN, 0, 0, 0)[0] == NOT_INITIALIZED
    assert drv.cuInit(0) == (OK,)
    assert drv.cuMemAddressReserve(GRAN, 0, 0, 0)[0] == INVALID_CONTEXT         # no current context
    dev = drv.cuDeviceGet(0)[1]
    ctx = drv.cuDevicePrimaryCtxRetain(dev)[1]
    drv.cuCtxSetCurrent(ctx)
    assert drv.cuMemAddressReserve(GRAN + 1, 0, 0, 0)[0] == INVALID_VALUE       # not a granularity multiple
    ptr = int(drv.cuMemAddressReserve(2 * GRAN, 0, 0, 0)[1])
    prop = drv.CUmemAllocationProp()
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    assert drv.cuMemCreate(GRAN, prop, 0)[0] == INVALID_VALUE                    # not PINNED
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert drv.cuMemCreate(GRAN, prop, 1)[0] == INVALID_VALUE                    # flags must be 0
    h = drv.cuMemCreate(GRAN, prop, 0)[1]
    assert drv.cuMemMap(ptr + 4096, GRAN, 0, h, 0) == (INVALID_VALUE,)          # misaligned address
    assert drv.cuMemMap(ptr, GRAN, 0, h, 0) == (OK,)
    assert drv.cuMemMap(ptr, GRAN, 0, h, 0) == (INVALID_VALUE,)                 # already mapped
    desc = [drv.CUmemAccessDesc()]
    desc[0].location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc[0].flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    with pytest.raises(TypeError, match="not iterable"):
        drv.cuMemSetAccess(ptr, GRAN, desc[0], 1)                                # a bare struct
    assert drv.cuMemSetAccess(ptr, 2 * GRAN, desc, 1) == (INVALID_VALUE,)        # range not fully mapped
    assert drv.cuMemSetAccess(ptr, GRAN, desc, 1) == (OK,)
    assert drv.cuMemAddressFree(ptr, 2 * GRAN) == (INVALID_VALUE,)               # still mapped
    with pytest.raises(AssertionError, match="cuCtxSynchronize"):
        drv.cuMemUnmap(ptr, GRAN)                                                # kernels may still run
    drv.cuCtxSynchronize()
    assert drv.cuMemUnmap(ptr, GRAN) == (OK,)
    assert drv.cuMemAddressFree(ptr, GRAN) == (INVALID_VALUE,)                   # not the reserved size
    assert drv.cuMemAddressFree(ptr, 2 * GRAN) == (OK,)
    assert drv.cuMemRelease(h) == (OK,)
    with pytest.raises(AssertionError, match="cuCtxCreate"):
        drv.cuCtxCreate(None, 0, dev)


# -- granularity ----------------------------------------------------------------------------------------------
def test_page_size_defaults_to_and_rounds_up_to_the_granularity(fake, caplog):
    assert CudaVirtualMemory(0, driver=fake).page_size == GRAN
    with caplog.at_level(logging.WARNING, logger="kvlab.vmm"):
        vm = CudaVirtualMemory(0, page_size=64 * 1024, driver=FakeCudaDriver(granularity=GRAN))
    assert vm.page_size == GRAN and "granularity" in caplog.text
    assert CudaVirtualMemory(0, page_size=3 * MiB, driver=FakeCudaDriver()).page_size == 4 * MiB


def test_reservations_round_up_to_whole_pages(vm, fake):
    assert vm.reserve(1).nbytes == GRAN
    assert vm.reserve(5 * MiB).nbytes == 6 * MiB
    assert sorted(fake.reservations.values()) == [GRAN, 6 * MiB]
    with pytest.raises(DriverError, match="page-aligned"):
        vm.map(vm.regions[0], 4096, 0)


# -- call order -----------------------------------------------------------------------------------------------
def test_call_order(fake):
    vm = CudaVirtualMemory(0, driver=fake)
    region = vm.reserve(4 * GRAN)
    vm.create_store(3)
    vm.map(region, 0, 0, 2)
    vm.map(region, 3 * GRAN, 2)
    vm.unmap(region, 0, 2)
    vm.release(region)
    vm.close()
    names = fake.names()
    assert names[:4] == ["cuInit", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain"]
    assert "cuCtxCreate" not in names
    assert index(names, "cuCtxSetCurrent") < index(names, "cuMemGetAllocationGranularity") \
        < index(names, "cuMemAddressReserve") < index(names, "cuMemCreate")
    # a run of two pages: two maps, then one set-access over the run
    first_map = index(names, "cuMemMap")
    assert names[first_map:first_map + 3] == ["cuMemMap", "cuMemMap", "cuMemSetAccess"]
    assert names[first_map + 3:first_map + 5] == ["cuMemMap", "cuMemSetAccess"]
    sync = index(names, "cuCtxSynchronize")
    assert names[sync:sync + 3] == ["cuCtxSynchronize", "cuMemUnmap", "cuMemUnmap"]
    assert index(names, "cuMemUnmap") < index(names, "cuMemAddressFree")
    assert names[-4:] == ["cuMemRelease"] * 3 + ["cuDevicePrimaryCtxRelease"]
    assert fake.leaks() == {}
    assert vm.stats.map_calls == 5 and vm.stats.unmap_calls == 3 and vm.stats.num_mappings == 0


def test_every_thread_gets_the_primary_context(vm, fake):
    region = vm.reserve(2 * GRAN)
    vm.create_store(2)
    errors = []

    def worker():
        try:
            vm.map(region, GRAN, 1)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == []
    tid = next(t for name, t in fake.calls if name == "cuMemMap")
    assert ("cuCtxSetCurrent", tid) in fake.calls and fake.current[tid] == fake.primary_context(0)
    assert fake.calls.count(("cuCtxSetCurrent", tid)) == 1


def test_a_foreign_current_context_is_refused(fake):
    vm = CudaVirtualMemory(0, driver=fake)

    def worker(out):
        fake.current[threading.get_ident()] = 0xBAD
        try:
            vm.reserve(GRAN)
        except DriverError as exc:
            out.append(str(exc))
    out: list[str] = []
    thread = threading.Thread(target=worker, args=(out,))
    thread.start()
    thread.join()
    assert out and "primary context" in out[0] and "torch.cuda.set_device(0)" in out[0]
    vm.close()


# -- errors and their clean-up ---------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["cuInit", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
                                  "cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemGetAllocationGranularity"])
@pytest.mark.parametrize("kind", ["result", "exception"])
def test_start_up_failures_name_the_call_and_release_the_context(fake, call, kind):
    if kind == "result":
        fake.fail(call, INVALID_VALUE)
        expected = f"{call} failed with CUDA_ERROR_INVALID_VALUE"
    else:
        fake.fail(call, exc=RuntimeError("driver exploded"))
        expected = f"{call} failed: RuntimeError: driver exploded"
    with pytest.raises(DriverError) as info:
        CudaVirtualMemory(0, driver=fake)
    assert expected in str(info.value)
    assert fake.leaks() == {}


def test_a_device_without_vmm_is_refused(fake):
    fake.vmm_supported = False
    with pytest.raises(DriverError, match="does not support CUDA virtual memory"):
        CudaVirtualMemory(0, driver=fake)
    assert fake.leaks() == {}


def test_reserve_failure_acquires_nothing(vm, fake):
    fake.fail("cuMemAddressReserve", OUT_OF_MEMORY)
    with pytest.raises(DriverError, match="cuMemAddressReserve failed with CUDA_ERROR_OUT_OF_MEMORY"):
        vm.reserve(GRAN)
    assert vm.regions == [] and fake.reservations == {} and vm.stats.reserved_bytes == 0


@pytest.mark.parametrize("kind", ["result", "exception"])
def test_pool_creation_failure_releases_the_pages_created(vm, fake, kind):
    fake.fail("cuMemCreate", OUT_OF_MEMORY, after=2, exc=RuntimeError("boom") if kind == "exception" else None)
    with pytest.raises(DriverError, match="cuMemCreate"):
        vm.create_store(4)
    assert fake.handles == {} and vm.stats.store_pages == 0
    vm.create_store(4)
    assert len(fake.handles) == 4


def test_out_of_device_memory_is_a_clear_error(fake):
    fake.memory_bytes = 3 * GRAN
    vm = CudaVirtualMemory(0, driver=fake)
    with pytest.raises(DriverError, match="cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY"):
        vm.create_store(4)
    vm.close()
    assert fake.leaks() == {}


@pytest.mark.parametrize("call,after", [("cuMemMap", 0), ("cuMemMap", 2), ("cuMemSetAccess", 0)])
def test_map_failure_undoes_the_partial_mapping(vm, fake, call, after):
    region = vm.reserve(4 * GRAN)
    vm.create_store(4)
    fake.fail(call, INVALID_VALUE, after=after)
    with pytest.raises(DriverError, match=call):
        vm.map(region, 0, 0, 3)
    assert fake.mappings == {} and region.mapped == {} and vm.stats.mapped_pages == 0
    vm.map(region, 0, 0, 3)                                     # and the range is usable again
    assert len(fake.mappings) == 3


def test_unmap_failure_names_the_call(vm, fake):
    region = vm.reserve(GRAN)
    vm.create_store(1)
    vm.map(region, 0, 0)
    fake.fail("cuCtxSynchronize", INVALID_VALUE)
    with pytest.raises(DriverError, match="cuCtxSynchronize failed"):
        vm.unmap(region, 0)
    assert region.mapped == {0: 0}                               # nothing changed: it is still mapped
    fake.fail("cuMemUnmap", exc=RuntimeError("lost"))
    with pytest.raises(DriverError, match="cuMemUnmap failed: RuntimeError: lost"):
        vm.unmap(region, 0)
    assert region.mapped == {0: 0} and len(fake.mappings) == 1   # the fixture's close still unmaps it


def test_an_unmap_failing_partway_through_a_run_books_the_pages_it_unmapped(vm, fake):
    """Reported: page 0 of a 2-page run was unmapped on the device but still booked, so close() leaked."""
    region = vm.reserve(2 * GRAN)
    vm.create_store(2)
    vm.map(region, 0, 0, 2)
    fake.fail("cuMemUnmap", INVALID_VALUE, after=1)
    with pytest.raises(DriverError, match=r"cuMemUnmap failed .* \(after unmapping 1 of 2 pages\)"):
        vm.unmap(region, 0, 2)
    assert region.mapped == {1: 1} and set(fake.mappings) == {region.base + GRAN}
    assert vm.stats.mapped_pages == 1 and vm.stats.num_mappings == 1 and list(vm.store_maps) == [0, 1]
    # the fixture's close unmaps page 1 and frees everything


def test_a_map_whose_undo_fails_books_what_stays_mapped(vm, fake):
    region = vm.reserve(4 * GRAN)
    vm.create_store(4)
    fake.fail("cuMemSetAccess", INVALID_VALUE)
    fake.fail("cuMemUnmap", INVALID_VALUE, after=1)              # the undo unmaps page 2, then page 1 fails
    with pytest.raises(DriverError, match="cuMemSetAccess failed .* left 2 mapped"):
        vm.map(region, 0, 0, 3)
    assert region.mapped == {0: 0, 1: 1} and set(fake.mappings) == {region.base, region.base + GRAN}
    assert vm.stats.mapped_pages == 2 and vm.stats.num_mappings == 2


def test_a_mirrored_unmap_failing_in_the_second_tensor_maps_the_first_back(vm, fake):
    places = [(vm.reserve(2 * GRAN), 0), (vm.reserve(2 * GRAN), 0)]
    vm.create_store(4)
    mirror = vm.mirror(places, 2 * GRAN, 2)
    vm.map_mirrored(mirror, 0, 0, 2)
    fake.launch()
    fake.fail("cuMemUnmap", INVALID_VALUE, after=2)              # tensor 0 unmaps both pages, tensor 1 refuses
    calls = len(fake.calls)
    with pytest.raises(DriverError, match="cuMemUnmap"):
        vm.unmap_mirrored(mirror, 0, 2)
    assert fake.names()[calls:] == ["cuCtxSynchronize", "cuMemUnmap", "cuMemUnmap", "cuCtxSynchronize",
                                    "cuMemUnmap", "cuMemMap", "cuMemMap", "cuMemSetAccess"]
    assert [r.mapped for r, _ in places] == [{0: 0, 1: 1}, {0: 2, 1: 3}] and len(fake.mappings) == 4
    assert all(m.accessible for m in fake.mappings.values())
    vm.unmap_mirrored(mirror, 0, 2)
    assert fake.mappings == {} and vm.stats.mapped_pages == 0


def test_a_page_that_never_unmaps_keeps_only_itself_and_its_range(fake):
    vm = CudaVirtualMemory(0, driver=fake)
    a, b = vm.reserve(2 * GRAN), vm.reserve(GRAN)
    vm.create_store(3)
    vm.map(a, 0, 0, 2)
    vm.map(b, 0, 2)
    fake.fail("cuMemUnmap", INVALID_VALUE)                       # a's run, then the retry of its page 0
    fake.fail("cuMemUnmap", INVALID_VALUE)
    with pytest.raises(DriverError, match=r"3 driver call\(s\) failed .*cuMemAddressFree of the range at .* "
                                          r"skipped.*still held: 1 range\(s\) with 1 mapped page\(s\)"):
        vm.close()
    assert vm.closed and vm.stats.release_retries == 1 and a.mapped == {0: 0} and b.released
    leaks = fake.leaks()
    assert leaks == {"reservations": {a.base: 2 * GRAN}, "mappings": [a.base]}   # every handle was released


def test_close_releases_no_mapped_handle_without_a_synchronise(fake):
    """docs/gpu-contracts.md §1.5: a handle still mapped (its unmap failed twice) is released only after a successful
    cuCtxSynchronize; when that fails too it stays, and the error says so."""
    vm = CudaVirtualMemory(0, driver=fake)
    region = vm.reserve(2 * GRAN)
    vm.create_store(2)
    vm.map(region, 0, 0, 2)
    fake.fail("cuMemUnmap", INVALID_VALUE)
    fake.fail("cuMemUnmap", INVALID_VALUE)
    fake.fail("cuCtxSynchronize", INVALID_VALUE, after=3)         # run, page 0, page 1, then close's own
    with pytest.raises(DriverError, match=r"1 handle\(s\) still mapped are not released: cuCtxSynchronize"):
        vm.close()
    assert {k: len(v) for k, v in fake.leaks().items()} == {"reservations": 1, "handles": 1, "mappings": 1}


def test_close_releases_everything_even_after_a_failure(fake):
    vm = CudaVirtualMemory(0, driver=fake)
    region = vm.reserve(2 * GRAN)
    vm.create_store(3)
    vm.map(region, 0, 0, 2)
    fake.fail("cuMemRelease", INVALID_VALUE, after=1)
    with pytest.raises(DriverError, match="cuMemRelease"):
        vm.close()
    leaks = fake.leaks()
    assert list(leaks) == ["handles"] and len(leaks["handles"]) == 1   # only the one whose release failed
    assert fake.mappings == {} and fake.reservations == {}


def test_discarded_pages_are_created_again_when_mapped(vm, fake):
    region = vm.reserve(2 * GRAN)
    vm.create_store(2)
    vm.discard(0, 2)
    assert fake.handles == {}
    vm.map(region, 0, 0, 2)
    assert len(fake.handles) == 2 and len(fake.mappings) == 2


def test_views_over_an_unmapped_reservation_query_no_pointer(vm, fake, monkeypatch):
    """Issue 18: the cache builds its views before any page is mapped. With torch behaving as on a GPU (a
    `__cuda_array_interface__` makes it query the pointer, which fails on an unmapped reservation), the view is
    built all the same: through DLPack with the device stated, and the driver is never asked about the pointer."""
    torch_interop(monkeypatch, fake)
    region = vm.reserve(2 * GRAN)
    with pytest.raises(RuntimeError, match="cudaPointerGetAttributes"):   # the failure the fake reproduces
        torch.as_tensor(ViewHolderWithInterface(region.base))
    queries = fake.names().count("cuPointerGetAttribute")
    view = vm.tensor_view(region, torch.float16, (4, 8), offset=64)
    assert view.shape == (4, 8) and view.dtype == torch.float16
    assert fake.names().count("cuPointerGetAttribute") == queries


class ViewHolderWithInterface:
    """What the driver used to hand torch (a regression would build views this way)."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {"shape": (128,), "typestr": "|u1", "data": (ptr, False), "strides": None,
                                         "version": 3}


def test_dlpack_views_share_memory_and_keep_their_holder_until_the_last_view_goes():
    import ctypes
    import gc
    import weakref

    from kvlab.vmm.drivers.dlpack import byte_tensor
    buf, gone = (ctypes.c_uint8 * 64)(), []

    class Holder:
        pass
    holder = Holder()
    weakref.finalize(holder, gone.append, True)
    raw = byte_tensor(ctypes.addressof(buf), 64, torch.device("cpu"), holder)
    del holder
    view = raw.view(torch.float32)[2:]
    del raw
    gc.collect()
    assert not gone                                  # a view is still alive
    view[0] = 1.0
    assert bytes(buf[8:12]) == torch.tensor([1.0]).numpy().tobytes()   # zero-copy
    del view
    gc.collect()
    assert gone == [True]
    with pytest.raises(ValueError, match="cuda:N"):
        byte_tensor(ctypes.addressof(buf), 64, torch.device("cuda"), None)


def test_fresh_device_pages_are_garbage_not_zeros(vm, fake):
    """cuMemCreate memory is not zeroed (issue 18): neither a new page nor one created again after a discard."""
    region = vm.reserve(GRAN)
    vm.create_store(1)
    vm.map(region, 0, 0)
    first = fake.read(region.base, 64)
    assert first != bytes(64)
    vm.unmap(region, 0)
    vm.discard(0)
    vm.map(region, 0, 0)                              # created again: new garbage
    again = fake.read(region.base, 64)
    assert again != bytes(64) and again != first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_real_bindings_without_a_gpu_raise_a_clear_error():
    pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(DriverError, match=r"cuInit failed: \w+Error"):
        CudaVirtualMemory(0)


# -- the cache drives the CUDA driver (accounting mode: no tensors, every driver call real) ---------------------
def test_cache_growth_reclaim_and_close_through_the_cuda_driver(fake):
    cfg = make_config(backend="vmm", device="cuda", page_size=GRAN, kv_cache_bytes=4 * 4 * GRAN,
                       max_num_seqs=2, max_model_len=4096, max_num_batched_tokens=4096)
    shape = KVShape(num_layers=2, num_kv_heads=8, head_dim=128, num_q_heads=8, dtype="float16", device="cuda")
    cache = build_vmm(cfg, shape, accounting_only=True, driver=CudaVirtualMemory(0, driver=fake))
    assert cache.allocator.tokens_per_unit == 1024 and cache.allocator.num_total_units() == 4
    a, b = Sequence(0, "a", [1] * 2000, 8), Sequence(1, "b", [1] * 100, 8)
    cache.allocator.allocate(a, 2000)              # 2 consecutive groups: per tensor, 2 cuMemMap + 1 cuMemSetAccess
    assert fake.names().count("cuMemMap") == 8 and fake.names().count("cuMemSetAccess") == 4
    cache.allocator.free(a)                                              # deferred: nothing unmapped
    assert "cuMemUnmap" not in fake.names()
    cache.allocator.allocate(b, 100)
    fake.launch()                                              # a kernel may be reading
    c = Sequence(2, "c", [1] * 3000, 8)
    cache.allocator.allocate(c, 3000)              # 3 groups: the 2 in the pool + b's page left over from a (reclaimed)
    names = fake.names()
    assert "cuMemUnmap" in names and names[names.index("cuMemUnmap") - 1] == "cuCtxSynchronize"
    cache.check_invariants()
    assert cache.stats().num_mappings == 4 * 4
    cache.close()
    assert fake.leaks() == {}
