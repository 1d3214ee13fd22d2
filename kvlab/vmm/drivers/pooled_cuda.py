"""A pooled driver's GPU part: pool pages are `page_size` pieces of the pool's exportable cuMemCreate chunks
(vmm/pool/cuda_chunks.py), mapped with cuMemMap at their offset into the engine's own reservations (the cuda
driver's reserve, release, unmap and DLPack views). A chunk cannot give part of its memory back, so a page new to
this engine from the pool is zeroed when first mapped: it never shows another engine's KV. The pool's creator
makes the chunks once it has claimed the name, so engines starting together never both hold the whole budget;
every joiner imports each chunk once from the descriptors the pool passes."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.cuda import CudaMemory
from kvlab.vmm.drivers.cuda_device import cuda_index
from kvlab.vmm.drivers.types import PartialCall
from kvlab.vmm.pool import PoolMember, create, join_or_create
from kvlab.vmm.pool.cuda_chunks import CudaChunks, chunk_size


class CudaPoolPages:
    name = "cuda"

    def __init__(self, memory: CudaMemory, chunks: CudaChunks) -> None:
        self.memory, self.chunks, self.page_size = memory, chunks, memory.page_size
        self.fresh: set[int] = set()       # pool pages taken from the pool and not yet mapped (zeroed then)

    def map_page(self, addr: int, pool_page: int) -> int:
        self.chunks.map(addr, pool_page)
        if pool_page not in self.fresh:
            return 2
        try:
            self.chunks.zero(addr)
        except BaseException:
            self.chunks.unmap(addr)
            raise
        self.fresh.discard(pool_page)
        return 3

    def map_run(self, addr: int, pool_page: int, num_pages: int) -> int:
        """Page by page (each pool page is its own chunk mapping); a failure after some pages: PartialCall."""
        calls = 0
        for i in range(num_pages):
            try:
                calls += self.map_page(addr + i * self.page_size, pool_page + i)
            except DriverError as e:
                if i:
                    raise PartialCall(str(e), i) from e
                raise
        return calls

    def taken(self, pool_pages: list[int]) -> None:
        self.fresh.update(pool_pages)

    def gone(self, pool_pages: list[int]) -> None:
        self.fresh.difference_update(pool_pages)

    def close(self, store_maps: Sequence[int]) -> None:
        """This process's chunk handles, then the context (the chunks' memory goes with the pool's last member)."""
        try:
            self.chunks.close()
        finally:
            self.memory.close(store_maps)


class ChunkMaker:
    """The pool's memory for its creator: called once the name is claimed, makes the chunks and returns their
    descriptors; keeps the chunks for this process's own maps."""

    def __init__(self, memory: CudaMemory, nbytes: int) -> None:
        self.memory, self.nbytes, self.chunks = memory, nbytes, None

    def __call__(self) -> list[int]:
        page = self.memory.page_size
        chunks = CudaChunks.create(self.memory.cuda, self.nbytes, chunk_size(self.nbytes, page), page)
        try:
            fds = chunks.export()
        except BaseException:
            chunks.close()
            raise
        self.chunks = chunks
        return fds


def cuda_pool_pages(pool: str, nbytes: int | None, page_size: int, device: str, driver: Any = None,
                    backend: str = "vmm") -> tuple[PoolMember, CudaPoolPages]:
    """An engine's way in: join pool `pool` (importing its chunks) or create it (making them) on `device`."""
    def enter(memory: CudaMemory, maker: ChunkMaker) -> PoolMember:
        return join_or_create(pool, nbytes, memory.page_size, memory.cuda.device, maker, backend)
    return on_device(device, page_size, driver, nbytes, enter)


def create_cuda_pool(name: str, nbytes: int, page_size: int, device: str, engine: str,
                     driver: Any = None) -> tuple[PoolMember, CudaPoolPages]:
    """A new pool on `device` held by `engine`, which takes no pages (`kvlab pool create --device cuda`)."""
    def enter(memory: CudaMemory, maker: ChunkMaker) -> PoolMember:
        return create(name, nbytes, memory.page_size, engine=engine, ceiling=0, memory=maker,
                      device=memory.cuda.device)
    return on_device(device, page_size, driver, nbytes, enter)


def on_device(device: str, page_size: int, driver: Any, nbytes: int | None,
              enter: Callable[[CudaMemory, ChunkMaker], PoolMember]) -> tuple[PoolMember, CudaPoolPages]:
    """The device's memory, a member entered by `enter`, and its chunks (made by the maker if it created the
    pool, else imported); all released if any step fails."""
    memory = CudaMemory(cuda_index(device), page_size, driver)
    maker, member = ChunkMaker(memory, nbytes or 0), None
    try:
        member = enter(memory, maker)
        chunks = maker.chunks or CudaChunks.imported(memory.cuda, member.chunk_fds, member.chunk_bytes,
                                                     memory.page_size)
        return member, CudaPoolPages(memory, chunks)
    except BaseException:
        for part in (maker.chunks, member):
            if part is not None:
                part.close()
        memory.close([])
        raise
