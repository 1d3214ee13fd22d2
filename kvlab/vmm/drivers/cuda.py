"""Real virtual memory on an NVIDIA GPU through `cuda.bindings.driver` (the CUDA driver API's VMM calls).

reserve = cuMemAddressReserve; store = one cuMemCreate handle (pinned device memory) per page, created up front;
map = cuMemMap per page + one cuMemSetAccess per mapped run; unmap = cuCtxSynchronize, then cuMemUnmap per page;
discard = cuMemRelease (the page is created again when next mapped); release = cuMemAddressFree.
A map that fails undoes its pages (last first); an unmap that fails partway, or an undo that does, reports the
pages that did change (`PartialCall`) so the books stay exact. A range is freed only once nothing is mapped in it,
and close() releases a still-mapped handle only after a successful cuCtxSynchronize (the driver
frees a released handle's memory once nothing maps it; before the synchronise kernels may still read it).
The device, its checked calls and the store's handles are vmm/drivers/cuda_device.py.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.cuda_device import CudaDevice, PageHandles, as_int, import_driver
from kvlab.vmm.drivers.dlpack import byte_tensor
from kvlab.vmm.drivers.types import PartialCall, Region

__all__ = ["CudaMemory", "CudaVirtualMemory", "as_int", "import_driver"]

log = logging.getLogger("kvlab.vmm")


class ViewHolder:
    """Kept alive by torch while any tensor over the range lives (the DLPack deleter drops it); holds the region so
    the reservation outlives every view."""
    __slots__ = ("__weakref__", "region")

    def __init__(self, region: Region) -> None:
        self.region = region


class CudaMemory:
    """The CUDA driver calls (`OSMemory`) on one device. `page_size` defaults to the device's minimum granularity
    and is rounded up to a multiple of it (logged)."""

    name = "cuda"
    merges = False   # every cuMemMap is its own mapping
    unmaps_runs = False

    def __init__(self, device: int = 0, page_size: int | None = None, driver: Any = None) -> None:
        self.cuda = CudaDevice(device, driver)
        self.page_size = self.cuda.rounded_page_size(page_size)
        self.handles = PageHandles(self.cuda, self.page_size)

    def granularity(self) -> int:
        return self.cuda.granularity

    def reserve(self, nbytes: int) -> int:
        self.cuda.ensure_context()
        return as_int(self.cuda.call("cuMemAddressReserve", nbytes, 0, 0, 0))

    def release(self, region: Region) -> None:
        if region.pages:   # their unmap failed; cuMemAddressFree takes a bare reservation only
            raise DriverError(f"cuMemAddressFree of the range at {region.base:#x} skipped: {len(region.pages)} of its "
                              "pages could not be unmapped")
        self.cuda.ensure_context()
        self.cuda.call("cuMemAddressFree", region.base, region.nbytes)

    def resize_store(self, old_pages: int, new_pages: int) -> None:
        self.cuda.ensure_context()
        self.handles.resize(old_pages, new_pages)

    def map(self, addr: int, first_page: int, num_pages: int) -> int:
        self.cuda.ensure_context()
        ps, done = self.page_size, 0
        try:
            for i in range(num_pages):
                self.cuda.call("cuMemMap", addr + i * ps, ps, 0, self.handles.get(first_page + i), 0)
                done += 1
            self.cuda.call("cuMemSetAccess", addr, num_pages * ps, self.cuda.access, 1)
        except BaseException as exc:
            left = self._undo_maps(addr, done)
            if left:
                raise PartialCall(f"{exc}; undoing the {done} page(s) mapped before it left {left} mapped", left
                                  ) from exc
            raise
        return num_pages + 1

    def _undo_maps(self, addr: int, done: int) -> int:
        """Unmap the first `done` pages at addr, last first; returns how many stay mapped (a prefix)."""
        try:
            if done:
                self.cuda.call("cuCtxSynchronize")
            for i in reversed(range(done)):
                self.cuda.call("cuMemUnmap", addr + i * self.page_size, self.page_size)
                done = i
        except DriverError as exc:
            log.error("could not undo a failed mapping at %#x: %s", addr, exc)
        return done

    def unmap(self, addr: int, num_pages: int) -> int:
        self.cuda.ensure_context()
        self.cuda.call("cuCtxSynchronize")   # kernels may still read these pages; unmap does not wait for them
        for i in range(num_pages):
            try:
                self.cuda.call("cuMemUnmap", addr + i * self.page_size, self.page_size)
            except DriverError as exc:
                if i == 0:
                    raise
                raise PartialCall(f"{exc} (after unmapping {i} of {num_pages} pages)", i) from exc
        return num_pages

    def discard(self, first_page: int, num_pages: int) -> None:
        self.cuda.ensure_context()
        self.handles.discard(first_page, num_pages)

    def view(self, region: Region, offset: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        """Through DLPack with the device stated, never `__cuda_array_interface__`: that makes torch query the
        pointer, which fails while the range's first page is unmapped (issue 18)."""
        holder = ViewHolder(region)
        device = self.cuda.device
        try:
            tensor = byte_tensor(region.base + offset, nbytes, torch.device("cuda", device), holder)
        except Exception as exc:
            raise DriverError(f"torch.from_dlpack over the range at {region.base:#x} failed on cuda:{device}: "
                              f"{type(exc).__name__}: {exc}") from exc
        return tensor, holder

    def close(self, store_maps: Sequence[int]) -> None:
        """Release every handle, then the primary context."""
        try:
            self.cuda.ensure_context()
            self.handles.close(store_maps)
        finally:
            self.cuda.release_primary(log_errors=False)


class CudaVirtualMemory(VirtualMemory):
    """Virtual memory over `CudaMemory` on `device`; `driver`: the cuda.bindings driver module or a fake. `drv` and
    `call` are the device's, for callers that make driver calls of their own (experiments/gpu/check.py)."""

    def __init__(self, device: int = 0, page_size: int | None = None, driver: Any = None) -> None:
        memory = CudaMemory(device, page_size, driver)
        super().__init__(memory, memory.page_size)
        self.device, self.requested_page_size = device, page_size
        self.drv, self.call = memory.cuda.drv, memory.cuda.call
