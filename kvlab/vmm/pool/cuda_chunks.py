"""A pool's pages on a GPU (docs/pool.md, "CUDA handles"): a few large `cuMemCreate` allocations, the chunks, made
with requestedHandleTypes POSIX_FILE_DESCRIPTOR so each exports as a file descriptor. The creator makes them; every
other member imports each chunk once from the descriptors passed at join (as the host pool passes its memfd) and
closes the descriptors. Page p is `page_size` bytes at offset (p % pages_per_chunk) * page_size of chunk
p // pages_per_chunk, mapped with cuMemMap at that offset plus cuMemSetAccess. Chunk and page sizes are multiples
of the device's granularity. A chunk's memory is released only when every member has released its handle and
unmapped it, so the pool's budget is held on the device from creation: there is no punch-hole, and a page given
back is zeroed with cuMemsetD8 while the giver still maps it (the next owner reads zeros, as on the host).

Written against `cuda.bindings.driver` through `CudaDevice`'s checked calls; tested with the fake driver."""
from __future__ import annotations

import os
from typing import Any

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.cuda_device import CudaDevice, as_int, release_handles
from kvlab.vmm.pool.errors import LimitError
from kvlab.vmm.pool.rendezvous import MAX_MEMORY_FDS

MAX_CHUNK_BYTES = 4 << 30      # a 141 GB H200 pool is 36 chunks, within the descriptors one join passes


def posix_fd(drv: Any) -> Any:
    return drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def exportable_prop(cuda: CudaDevice) -> Any:
    """The device's allocation properties, asking for a handle exportable as a POSIX file descriptor."""
    drv = cuda.drv
    prop = drv.CUmemAllocationProp()
    prop.type = cuda.prop.type
    prop.location.type, prop.location.id = cuda.prop.location.type, cuda.prop.location.id
    prop.requestedHandleTypes = posix_fd(drv)
    return prop


def check_sizes(total: int, chunk: int, page: int, granularity: int) -> int:
    """The chunk count; one-line LimitErrors for sizes the device or the layout cannot take."""
    if page <= 0 or page % granularity:
        raise LimitError(f"page size {page} is not a positive multiple of the device's granularity {granularity}")
    if chunk <= 0 or chunk % page:
        raise LimitError(f"chunk size {chunk} is not a positive multiple of the page size {page}")
    if total <= 0 or total % chunk:
        raise LimitError(f"pool size {total} is not a positive multiple of the chunk size {chunk}")
    return total // chunk


def chunk_size(total: int, page: int) -> int:
    """The chunk size of a pool of `total` bytes: the fewest chunks of at most MAX_CHUNK_BYTES that split it into
    whole pages (fewer chunks: fewer handles and descriptors; a chunk's memory is held until the pool ends)."""
    if page <= 0 or total <= 0 or total % page:
        raise LimitError(f"pool size {total} is not a positive multiple of the page size {page}")
    pages = total // page
    for count in range(-(-total // MAX_CHUNK_BYTES), MAX_MEMORY_FDS + 1):
        if pages % count == 0:
            return total // count
    raise LimitError(f"a pool of {pages} pages splits into no {MAX_MEMORY_FDS} or fewer chunks of at most "
                     f"{MAX_CHUNK_BYTES >> 30} GiB; pick a size that is a multiple of a few GiB")


class CudaChunks:
    """The chunks' handles in this process (created or imported) and the calls that map, zero and unmap pages."""

    def __init__(self, cuda: CudaDevice, handles: list[int], chunk_bytes: int, page_size: int) -> None:
        self.cuda, self.handles, self.chunk_bytes, self.page_size = cuda, handles, chunk_bytes, page_size
        self.pages_per_chunk = chunk_bytes // page_size

    @classmethod
    def create(cls, cuda: CudaDevice, total_bytes: int, chunk_bytes: int, page_size: int) -> CudaChunks:
        count = check_sizes(total_bytes, chunk_bytes, page_size, cuda.granularity)
        cuda.ensure_context()
        prop = exportable_prop(cuda)
        return cls._made(cuda, count, chunk_bytes, page_size,
                         lambda _: as_int(cuda.call("cuMemCreate", chunk_bytes, prop, 0)))

    @classmethod
    def imported(cls, cuda: CudaDevice, fds: list[int], chunk_bytes: int, page_size: int) -> CudaChunks:
        """Import each chunk from its descriptor (the caller still owns and closes the descriptors)."""
        cuda.ensure_context()
        kind = posix_fd(cuda.drv)
        return cls._made(cuda, len(fds), chunk_bytes, page_size,
                         lambda i: as_int(cuda.call("cuMemImportFromShareableHandle", fds[i], kind)))

    @classmethod
    def _made(cls, cuda: CudaDevice, count: int, chunk_bytes: int, page_size: int, make: Any) -> CudaChunks:
        """All chunks or none: a failure releases the handles made before it."""
        chunks = cls(cuda, [], chunk_bytes, page_size)
        try:
            for i in range(count):
                chunks.handles.append(make(i))
        except BaseException:
            chunks.close()
            raise
        return chunks

    @property
    def total_pages(self) -> int:
        return len(self.handles) * self.pages_per_chunk

    def export(self) -> list[int]:
        """A new descriptor per chunk, to pass to a joiner; the caller closes them (all or none made)."""
        fds: list[int] = []
        try:
            for handle in self.handles:
                fds.append(int(self.cuda.call("cuMemExportToShareableHandle", handle, posix_fd(self.cuda.drv), 0)))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def where(self, page: int) -> tuple[int, int]:
        """(the chunk's handle, the page's byte offset in it)."""
        if not 0 <= page < self.total_pages:
            raise DriverError(f"page {page} is not in the pool's {self.total_pages} pages")
        chunk, index = divmod(page, self.pages_per_chunk)
        return self.handles[chunk], index * self.page_size

    def map(self, va: int, page: int) -> None:
        """Map pool page `page` read-write at `va` (page-aligned, reserved, unmapped); undone if access fails."""
        handle, offset = self.where(page)
        self.cuda.ensure_context()
        self.cuda.call("cuMemMap", va, self.page_size, offset, handle, 0)
        try:
            self.cuda.call("cuMemSetAccess", va, self.page_size, self.cuda.access, 1)
        except BaseException:
            self.cuda.call("cuMemUnmap", va, self.page_size)
            raise

    def zero(self, va: int) -> None:
        """Zero the page mapped at `va` (before giving it back: the next owner reads zeros)."""
        self.cuda.ensure_context()
        self.cuda.call("cuMemsetD8", va, 0, self.page_size)

    def unmap(self, va: int) -> None:
        """Unmap the page at `va` once the work that may read it is done."""
        self.cuda.ensure_context()
        self.cuda.call("cuCtxSynchronize")
        self.cuda.call("cuMemUnmap", va, self.page_size)

    def close(self) -> None:
        """Release this process's handles; a chunk's memory goes when every member's handle and mapping has."""
        handles, self.handles = self.handles, []
        if handles:
            self.cuda.ensure_context()
            release_handles(self.cuda, handles)
