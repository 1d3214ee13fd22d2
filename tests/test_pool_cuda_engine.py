"""Engines on a GPU pool (vmm/drivers/pooled_cuda.py) against the fake driver: the creator makes the chunks once it
holds the name, joiners import them, pages move between engines through the books, a page new to an engine reads
zeros (the chunks are not punched: the taker zeroes), a handoff keeps its data, a dead engine's pages come back,
host and GPU pools refuse each other's engines in one line, and nothing is left on any fake when they close."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from fakes.fake_cuda import FakeCudaDriver

from kvlab import LLM
from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError, DriverError
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.vmm import pool
from kvlab.vmm.build import build_vmm
from kvlab.vmm.drivers.pooled import PooledVirtualMemory
from kvlab.vmm.drivers.pooled_cuda import create_cuda_pool
from kvlab.vmm.pool import cuda_chunks
from kvlab.vmm.pool.errors import LimitError

GRAN = 2 << 20
PATTERN = bytes(range(1, 256)) * (GRAN // 255) + bytes(GRAN % 255)


def pool_name() -> str:
    return f"cudapool-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fakes():
    """Fake drivers, one per engine (as each process has its own): every one holds nothing at the end."""
    made: list[FakeCudaDriver] = []

    def make() -> FakeCudaDriver:
        made.append(FakeCudaDriver(granularity=GRAN))
        return made[-1]
    yield make
    for fake in made:
        assert fake.leaks() == {} and fake.mem.live_allocations() == 0


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of two pages, so a few pages span several chunks."""
    monkeypatch.setattr(cuda_chunks, "MAX_CHUNK_BYTES", 2 * GRAN)


def engine(name: str, fake: FakeCudaDriver, pool_bytes: int | None = None) -> PooledVirtualMemory:
    return PooledVirtualMemory(name, GRAN, pool_bytes, device="cuda:0", driver=fake)


def mapped(vm: PooledVirtualMemory, pages: int):
    region = vm.reserve(pages * GRAN)
    vm.create_store(max(len(vm.store_maps), pages))
    vm.map(region, 0, 0, pages)
    return region


def page_bytes(fake: FakeCudaDriver, region, i: int) -> bytes:
    return fake.read(region.base + i * GRAN, GRAN)


def close_all(*engines: PooledVirtualMemory) -> None:
    for vm in engines:
        vm.close()


def test_the_creator_makes_the_chunks_and_a_joiner_imports_each_once(fakes, small_chunks):
    name, made, joined = pool_name(), fakes(), fakes()
    a = engine(name, made, 8 * GRAN)
    b = engine(name, joined)
    try:
        assert made.names().count("cuMemCreate") == 4 and "cuMemImportFromShareableHandle" not in made.names()
        assert joined.names().count("cuMemImportFromShareableHandle") == 4 and "cuMemCreate" not in joined.names()
        status = pool.status(name)
        assert status.device == "cuda:0" and status.total == 8 and status.to_json()["device"] == "cuda:0"
    finally:
        close_all(b, a)
    with pytest.raises(pool.UnknownPool):       # its last member closed: the name is gone
        pool.status(name)


def test_pages_move_between_engines_and_a_page_new_to_an_engine_reads_zeros(fakes, small_chunks):
    """A fills the whole pool with a pattern and gives it back; B maps every page: zeros (the chunks kept A's
    bytes, B zeroed each page it took), and what B writes A reads after taking the pages again."""
    name, fa, fb = pool_name(), fakes(), fakes()
    a = engine(name, fa, 8 * GRAN)
    b = engine(name, fb)
    try:
        ra = mapped(a, 8)
        for i in range(8):
            fa.write(ra.base + i * GRAN, PATTERN)
        assert a.member.record().held == 8
        a.unmap(ra, 0, 8)
        assert a.pool.give_spare(8) == 8 and a.member.record().held == 0
        rb = mapped(b, 8)
        assert b.member.record().held == 8 and fb.names().count("cuMemsetD8") == 8
        assert all(page_bytes(fb, rb, i) == bytes(GRAN) for i in range(8))
        b.unmap(rb, 0, 8)
        b.map(rb, 0, 0, 8)                           # its own spares again: no zeroing, no take
        assert fb.names().count("cuMemsetD8") == 8 and b.member.record().taken == 8
        b.unmap(rb, 0, 8)
        b.pool.give_spare(8)
        a.map(ra, 0, 0, 8)
        assert all(page_bytes(fa, ra, i) == bytes(GRAN) for i in range(8))
    finally:
        close_all(b, a)


def test_a_full_pool_refuses_and_nothing_changes(fakes):
    name, fa, fb = pool_name(), fakes(), fakes()
    a = engine(name, fa, 4 * GRAN)
    b = engine(name, fb)
    try:
        mapped(a, 4)
        region = b.reserve(GRAN)
        b.create_store(1)
        with pytest.raises(DriverError, match="refused"):
            b.map(region, 0, 0, 1)
        assert b.member.record().held == 0 and not fb.mappings
    finally:
        close_all(b, a)


def test_a_handoff_keeps_the_pages_data(fakes, small_chunks):
    """The pages' ownership moves in the books (vmm/pool/transfer.py): the receiver backs its local pages with them
    and maps them, unzeroed, with the giver's data; the giver forgets them without giving."""
    name, fa, fb = pool_name(), fakes(), fakes()
    a = engine(name, fa, 8 * GRAN)
    b = engine(name, fb)
    try:
        ra = mapped(a, 2)
        fa.write(ra.base, PATTERN)
        fa.write(ra.base + GRAN, PATTERN[::-1])
        pages = [a.pool.pool_page(0), a.pool.pool_page(1)]
        a.unmap(ra, 0, 2)
        b.member.receive(a.member.index, os.getpid(), pages)
        b.create_store(4)
        b.pool.adopt({2: pages[0], 3: pages[1]})
        a.pool.disown([0, 1])
        rb = b.reserve(2 * GRAN)
        b.map(rb, 0, 2, 2)
        assert page_bytes(fb, rb, 0) == PATTERN and page_bytes(fb, rb, 1) == PATTERN[::-1]
        assert "cuMemsetD8" not in fb.names()
        assert a.member.record().held == 0 and b.member.record().held == 2
    finally:
        close_all(b, a)


def test_a_cache_grows_and_shrinks_on_a_gpu_pool_and_closes_clean(fakes):
    """The vmm cache over the pooled CUDA driver (accounting mode: no tensors, every driver call real)."""
    name, fake = pool_name(), fakes()
    cfg = make_config(backend="vmm", device="cuda", page_size=GRAN, kv_cache_bytes=4 * 4 * GRAN,
                      max_num_seqs=2, max_model_len=4096, max_num_batched_tokens=4096)
    shape = KVShape(num_layers=2, num_kv_heads=8, head_dim=128, num_q_heads=8, dtype="float16", device="cuda")
    cache = build_vmm(cfg, shape, accounting_only=True, driver=engine(name, fake, 16 * GRAN))
    a, b = Sequence(0, "a", [1] * 2000, 8), Sequence(1, "b", [1] * 1000, 8)
    assert cache.allocator.allocate(a, 2000) is not None and cache.allocator.allocate(b, 1000) is not None
    assert pool.status(name).used == 12                 # 3 groups of 4 tensors' pages
    cache.allocator.free(a)
    cache.check_invariants()
    stats = cache.stats().extra["pool"]
    assert stats["engine_bytes"] == stats["used_bytes"] == 12 * GRAN and stats["total_bytes"] == 16 * GRAN
    cache.close()
    with pytest.raises(pool.UnknownPool):
        pool.status(name)


def test_a_holder_creates_a_gpu_pool_and_its_memory_outlives_it_while_an_engine_maps_it(fakes, small_chunks):
    """`kvlab pool create --device cuda`'s way: a holder that takes no pages makes the chunks; an engine joins,
    maps and writes; the holder leaves first (releasing its handles): the engine's pages keep their bytes."""
    name, held, fake = pool_name(), fakes(), fakes()
    member, pages = create_cuda_pool(name, 8 * GRAN, GRAN, "cuda:0", "holder", driver=held)
    vm = engine(name, fake)
    try:
        assert member.record().ceiling == 0 and pool.status(name).device == "cuda:0"
        region = mapped(vm, 2)
        fake.write(region.base, PATTERN)
        pages.close([])
        member.close()
        assert held.leaks() == {} and fake.mem.live_allocations() == 4
        assert page_bytes(fake, region, 0) == PATTERN
    finally:
        vm.close()


# -- what cannot join, and failures half way ------------------------------------------------------------------
def test_host_and_gpu_pools_refuse_each_others_engines_in_one_line(fakes):
    fake = fakes()
    with pool.create(pool_name(), 1 << 20, page_size=4096) as host_pool:
        with pytest.raises(ConfigError, match="holds its pages on cpu; an engine on cuda:0") as e:
            engine(host_pool.name, fake)
        assert "\n" not in str(e.value) and len(host_pool.status().engines) == 1
    name = pool_name()
    gpu_engine = engine(name, fakes(), 4 * GRAN)
    try:
        with pytest.raises(ConfigError, match="holds its pages on cuda:0; an engine on cpu"):
            LLM(model="tiny", backend="vmm", kv_pool=name, page_size=GRAN)
        assert len(pool.status(name).engines) == 1
    finally:
        gpu_engine.close()


def test_no_pool_and_no_size_names_the_device_flag(fakes):
    with pytest.raises(ConfigError, match=r"kvlab pool create \S+ --bytes N --device cuda:0"):
        engine(pool_name(), fakes())


def test_a_pool_that_splits_into_no_few_chunks_is_one_line():
    with pytest.raises(LimitError, match="no 64 or fewer chunks"):
        cuda_chunks.chunk_size(4099 * GRAN * 1024, GRAN)        # 4099 is prime: 1 or 4099 chunks only
    assert cuda_chunks.chunk_size(2 * GRAN, GRAN) == 2 * GRAN
    assert cuda_chunks.chunk_size(12 << 30, GRAN) == 4 << 30


def test_a_failed_chunk_creation_leaves_no_pool_and_no_memory(fakes):
    name, fake = pool_name(), fakes()
    fake.fail("cuMemCreate")
    with pytest.raises(DriverError, match="cuMemCreate"):
        engine(name, fake, 4 * GRAN)
    with pytest.raises(pool.UnknownPool):          # the name was given up
        pool.status(name)


def test_a_failed_import_leaves_the_pool_and_holds_nothing(fakes, small_chunks):
    name, made, joined = pool_name(), fakes(), fakes()
    a = engine(name, made, 8 * GRAN)
    try:
        joined.fail("cuMemImportFromShareableHandle", after=2)
        with pytest.raises(DriverError, match="cuMemImportFromShareableHandle"):
            engine(name, joined)
        assert [e.name for e in pool.status(name).engines] == [a.member.engine]
    finally:
        a.close()


# -- another process ---------------------------------------------------------------------------------------
CHILD = """
import sys, time
from fakes.fake_cuda import FakeCudaDriver
from kvlab.vmm.drivers.pooled import PooledVirtualMemory
from kvlab.vmm.drivers.pooled_cuda import create_cuda_pool
GRAN = 2 << 20
fake = FakeCudaDriver(granularity=GRAN)
vm = PooledVirtualMemory(sys.argv[1], GRAN, device="cuda:0", driver=fake)
region = vm.reserve(4 * GRAN)
vm.create_store(4)
vm.map(region, 0, 0, 4)
for i in range(4):
    fake.write(region.base + i * GRAN, b"child" * (GRAN // 5))
print("mapped", flush=True)
time.sleep(120)
"""


def test_a_killed_engine_s_pages_come_back_and_read_zeros_to_the_next_owner(fakes):
    """A second process joins (its own fake), takes every page and writes them; kill -9; within the steward's
    rounds its pages are back, and this engine, taking them, reads zeros."""
    name, fake = pool_name(), fakes()
    vm = engine(name, fake, 4 * GRAN)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", CHILD, name], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")])))
    try:
        assert child.stdout.readline().strip() == "mapped"
        assert pool.status(name).used == 4
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.monotonic() + 5
        while pool.status(name).used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.status(name).used == 0 and pool.status(name).reclaimed_pages == 4
        region = mapped(vm, 4)
        assert all(page_bytes(fake, region, i) == bytes(GRAN) for i in range(4))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        vm.close()

