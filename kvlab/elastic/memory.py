"""The elastic pool's memory: the one module that talks to the VirtualMemory drivers (vmm/drivers/), so a change of
that interface is a change here only. One reserved range holds the 2L planes (elastic/geometry.py); a chunk is
mapped in every plane at once (one mirrored call, all or nothing) and unmapped the same way, and its pool pages are
then discarded, so physical memory follows the mapped chunks: the host driver punches the memfd pages out, the CUDA
driver releases their handles, the accounting driver (the simulator) only keeps the books.
"""
from __future__ import annotations

from typing import Any

import torch

from kvlab.common.errors import ConfigError
from kvlab.elastic.geometry import ChunkGeometry
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.factory import make_driver
from kvlab.vmm.pool.errors import PageSizeMismatch


def open_driver(device: str, page_size: int, accounting_only: bool, pool: str | None = None,
                pool_bytes: int | None = None) -> VirtualMemory:
    """The device's driver (host memfd on cpu, CUDA VMM on cuda), or the accounting one in the simulator; with
    `pool`, the pooled driver over that machine-wide pool (created with `pool_bytes` if none serves it yet),
    whose page must be elastic's (the pool's books count one page size), named in the books `elastic-PID-TAG`."""
    try:
        return make_driver(device, page_size, accounting_only, pool, pool_bytes, backend="elastic")
    except PageSizeMismatch as e:
        raise ConfigError(f"pool {pool!r} has a page size {e.pool_page}, not the engine's elastic_page_size "
                          f"{page_size}; set elastic_page_size (--elastic-page-size) to {e.pool_page}") from None


def driver_page_size(driver: VirtualMemory) -> int:
    """The page the driver maps (CUDA rounds the asked size up to its granularity)."""
    return driver.page_size


class ElasticMemory:
    """Reserve the planes, map and unmap chunks, hand out the pool tensor view, close."""

    def __init__(self, driver: VirtualMemory, geo: ChunkGeometry) -> None:
        self.driver, self.geo = driver, geo
        self.store_pages = 0
        try:
            self.region = driver.reserve(geo.reserved_bytes)
            places = [(self.region, i * geo.plane_bytes) for i in range(geo.planes)]
            self.mirror = driver.mirror(places, geo.plane_bytes, geo.pages_per_chunk)
        except BaseException:
            driver.close()
            raise
        # CUDA's fresh pages hold whatever was there: zero them, so padded kernel reads stay finite (paged/storage.py)
        self._zero_view: torch.Tensor | None = None
        self._zero_new = driver.name == "cuda"
        # the accounting driver has no memory to give back and its page-store books are costly to read
        # (vmm/drivers/mirror_books.py): its page store is made whole once and nothing is discarded
        self._has_memory = driver.name != "accounting"
        self.closed = False
        if not self._has_memory:
            self._grow_store(geo.num_chunks - 1)

    def map_chunk(self, chunk: int) -> None:
        """Back chunk `chunk` of every plane with physical pages (the pool grows to reach them)."""
        geo = self.geo
        self._grow_store(chunk)
        self.driver.map_mirrored(self.mirror, chunk * geo.chunk_bytes, geo.first_store_page(chunk), geo.pages_of(chunk))
        if self._zero_new:
            self._zero(chunk)

    def unmap_chunk(self, chunk: int) -> None:
        """Unmap chunk `chunk` of every plane and give its pages' memory back."""
        geo = self.geo
        self.driver.unmap_mirrored(self.mirror, chunk * geo.chunk_bytes, geo.pages_of(chunk))
        if self._has_memory:
            self.driver.discard(geo.first_store_page(chunk), geo.planes * geo.pages_per_chunk)

    def _grow_store(self, chunk: int) -> None:
        need = self.geo.store_pages_through(chunk)
        if need > self.store_pages:
            old, self.store_pages = self.store_pages, need
            self.driver.create_store(need)
            skipped = need - old - self.geo.planes * self.geo.pages_per_chunk
            if skipped > 0 and self._has_memory:   # the chunks below `chunk` are not mapped: no memory for them yet
                self.driver.discard(old, skipped)

    def _zero(self, chunk: int) -> None:
        if self._zero_view is None:
            self._zero_view = self.driver.tensor_view(self.region, torch.uint8, (self.geo.planes, self.geo.plane_bytes))
        at = chunk * self.geo.chunk_bytes
        self._zero_view[:, at:at + self.geo.pages_of(chunk) * self.geo.page_size].zero_()

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy view of the planes (reads nothing: unmapped chunks are never touched by it)."""
        return self.driver.tensor_view(self.region, dtype, shape, strides)

    def mapped_pages(self) -> int:
        """Pages mapped in every plane together, as the driver's books say."""
        return self.driver.stats.mapped_pages

    def stats(self) -> dict[str, Any]:
        st = self.driver.stats
        return {"num_mappings": st.num_mappings, "map_calls": st.map_calls, "unmap_calls": st.unmap_calls,
                "map_seconds": st.map_seconds, "unmap_seconds": st.unmap_seconds, "store_pages": self.store_pages,
                "discarded_pages": st.discarded_pages}

    def close(self) -> None:
        """Unmap everything and free the range (a view still alive defers that to its death). Idempotent."""
        if not self.closed:
            self.closed = True
            self._zero_view = None
            self.driver.close()
