"""Real virtual memory on an NVIDIA GPU through `cuda.bindings.driver` (gpu-apis.md §1).

reserve = cuMemAddressReserve; pool = one cuMemCreate handle (pinned device memory) per page, created up front;
map = cuMemMap per page + one cuMemSetAccess per mapped run; unmap = cuCtxSynchronize, then cuMemUnmap per page;
discard = cuMemRelease (the page is created again when next mapped); release = cuMemAddressFree.
A map that fails undoes its pages (last first); an unmap that fails partway, or an undo that does, reports the
pages that did change (`PartialCall`) so the books stay exact. A range is freed only once nothing is mapped in it,
and close() releases a still-mapped handle only after a successful cuCtxSynchronize (gpu-apis.md §1.4, §1.7).
Every driver call goes through `call`, which turns a raised exception and a non-zero CUresult alike into a
DriverError naming the call. Driver calls use the calling thread's current context, so each thread is given the
device's primary context (torch's) on first use; cuCtxCreate is never used (it would break torch interop).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.dlpack import byte_tensor
from kvlab.vmm.drivers.types import PartialCall, Region

log = logging.getLogger("kvlab.vmm")


def import_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DriverError("cuda.bindings is not importable (pip install cuda-python); the cuda VMM driver needs "
                          f"it: {exc}") from exc
    return driver


def as_int(handle: Any) -> int:
    """CUdeviceptr / CUcontext / handle objects -> int (None and NULL -> 0)."""
    return 0 if handle is None else int(handle)


class ViewHolder:
    """Kept alive by torch while any tensor over the range lives (the DLPack deleter drops it); holds the region so
    the reservation outlives every view."""
    __slots__ = ("__weakref__", "region")

    def __init__(self, region: Region) -> None:
        self.region = region


class CudaVirtualMemory(VirtualMemory):
    """`page_size` defaults to the device's minimum granularity and is rounded up to a multiple of it (logged).
    21 methods: the base class's OS seam (9) plus one checked wrapper per driver call it makes."""

    name = "cuda"
    merges = False   # every cuMemMap is its own mapping

    def __init__(self, device: int = 0, page_size: int | None = None, driver: Any = None) -> None:
        super().__init__(page_size or 1, mapping_limit=None)
        self.drv = driver if driver is not None else import_driver()
        self.device = device
        self.requested_page_size = page_size
        self._local = threading.local()
        self._handles: list[int | None] = []
        self._primary: Any = None
        if driver is None and torch.cuda.is_available():
            torch.cuda.init()   # torch owns (and creates) the primary context first
        try:
            self._open(device)
        except BaseException:
            self._release_primary(log_errors=True)
            raise
        self.page_size = self._page_size(page_size)

    # -- the one check ------------------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> Any:
        """Call drv.<name>(*args); return its output value(s); raise DriverError naming the call on failure."""
        try:
            err, *values = getattr(self.drv, name)(*args)
        except Exception as exc:
            raise DriverError(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                              ) from exc
        if int(err) != 0:
            raise DriverError(f"{name} failed with {getattr(err, 'name', 'CUresult')} ({int(err)}) on device "
                              f"{self.device}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    # -- set-up -------------------------------------------------------------------------------------------
    def _open(self, device: int) -> None:
        drv = self.drv
        self.call("cuInit", 0)
        self._dev = self.call("cuDeviceGet", device)
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
        if not self.call("cuDeviceGetAttribute", attr, self._dev):
            raise DriverError(f"device {device} does not support CUDA virtual memory management; use the paged "
                              "backend")
        self._primary = self.call("cuDevicePrimaryCtxRetain", self._dev)
        self._ensure_context()
        self._prop = self._allocation_prop()
        self._access = [self._access_desc()]
        option = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self._granularity = int(self.call("cuMemGetAllocationGranularity", self._prop, option))

    def _allocation_prop(self) -> Any:
        drv = self.drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        return prop

    def _access_desc(self) -> Any:
        drv = self.drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _page_size(self, requested: int | None) -> int:
        g = self._granularity
        size = -(-(requested or g) // g) * g
        if requested and size != requested:
            log.warning("page_size %d is not a multiple of device %d's allocation granularity %d; using %d",
                        requested, self.device, g, size)
        return size

    def _ensure_context(self) -> None:
        """Make the device's primary context current on this thread (once per thread)."""
        if getattr(self._local, "ready", False):
            return
        current = as_int(self.call("cuCtxGetCurrent"))
        if current == 0:
            self.call("cuCtxSetCurrent", self._primary)
        elif current != as_int(self._primary):
            raise DriverError(f"this thread's current CUDA context is not device {self.device}'s primary context; "
                              f"call torch.cuda.set_device({self.device}) on this thread first")
        self._local.ready = True

    def granularity(self) -> int:
        return self._granularity

    # -- OS calls -----------------------------------------------------------------------------------------
    def _os_reserve(self, nbytes: int) -> int:
        self._ensure_context()
        return as_int(self.call("cuMemAddressReserve", nbytes, 0, 0, 0))

    def _os_release(self, region: Region) -> None:
        if region.pages:   # their unmap failed; cuMemAddressFree takes a bare reservation only (gpu-apis.md §1.4)
            raise DriverError(f"cuMemAddressFree of the range at {region.base:#x} skipped: {len(region.pages)} of its "
                              "pages could not be unmapped")
        self._ensure_context()
        self.call("cuMemAddressFree", region.base, region.nbytes)

    def _os_resize_pool(self, old_pages: int, new_pages: int) -> None:
        self._ensure_context()
        if new_pages > old_pages:
            created = []
            try:
                for _ in range(new_pages - old_pages):
                    created.append(self._create())
            except BaseException:
                self._release_handles(created)
                raise
            self._handles.extend(created)
        else:
            cut = self._handles[new_pages:]
            del self._handles[new_pages:]
            self._release_handles([h for h in cut if h is not None])

    def _create(self) -> int:
        return as_int(self.call("cuMemCreate", self.page_size, self._prop, 0))

    def _release_handles(self, handles: list[int]) -> None:
        """Release every handle; then report the failures, if any, in one DriverError."""
        failed: list[DriverError] = []
        for h in handles:
            try:
                self.call("cuMemRelease", h)
            except DriverError as exc:
                failed.append(exc)
        if failed:
            raise DriverError(f"{len(failed)} of {len(handles)} cuMemRelease calls failed (first: {failed[0]})"
                              ) from failed[0]

    def _handle(self, page: int) -> int:
        if self._handles[page] is None:   # discarded earlier: create it again
            self._handles[page] = self._create()
        return self._handles[page]

    def _os_map(self, addr: int, first_page: int, num_pages: int) -> int:
        self._ensure_context()
        ps, done = self.page_size, 0
        try:
            for i in range(num_pages):
                self.call("cuMemMap", addr + i * ps, ps, 0, self._handle(first_page + i), 0)
                done += 1
            self.call("cuMemSetAccess", addr, num_pages * ps, self._access, 1)
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
                self.call("cuCtxSynchronize")
            for i in reversed(range(done)):
                self.call("cuMemUnmap", addr + i * self.page_size, self.page_size)
                done = i
        except DriverError as exc:
            log.error("could not undo a failed mapping at %#x: %s", addr, exc)
        return done

    def _os_unmap(self, addr: int, num_pages: int) -> int:
        self._ensure_context()
        self.call("cuCtxSynchronize")   # kernels may still read these pages; unmap does not wait for them
        for i in range(num_pages):
            try:
                self.call("cuMemUnmap", addr + i * self.page_size, self.page_size)
            except DriverError as exc:
                if i == 0:
                    raise
                raise PartialCall(f"{exc} (after unmapping {i} of {num_pages} pages)", i) from exc
        return num_pages

    def _os_discard(self, first_page: int, num_pages: int) -> None:
        self._ensure_context()
        gone = [h for h in self._handles[first_page:first_page + num_pages] if h is not None]
        self._handles[first_page:first_page + num_pages] = [None] * num_pages
        self._release_handles(gone)

    def _os_view(self, region: Region, offset: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        """Through DLPack with the device stated, never `__cuda_array_interface__`: that makes torch query the
        pointer, which fails while the range's first page is unmapped (gpu-apis.md §1.6, issue 18)."""
        holder = ViewHolder(region)
        try:
            tensor = byte_tensor(region.base + offset, nbytes, torch.device("cuda", self.device), holder)
        except Exception as exc:
            raise DriverError(f"torch.from_dlpack over the range at {region.base:#x} failed on cuda:{self.device}: "
                              f"{type(exc).__name__}: {exc}") from exc
        return tensor, holder

    def _os_close(self) -> None:
        """Release every handle (a handle still mapped after a failed unmap is freed when that unmap happens,
        gpu-apis.md §1.4, but only after a successful synchronise: §1.7)."""
        try:
            self._ensure_context()
            handles, self._handles = self._handles, []
            mapped = {h for p, h in enumerate(handles) if h is not None and self.pool_maps[p]}
            failed: list[DriverError] = []
            if mapped:
                try:
                    self.call("cuCtxSynchronize")
                except DriverError as exc:
                    failed.append(DriverError(f"{len(mapped)} handle(s) still mapped are not released: {exc}"))
                    handles = [h for h in handles if h not in mapped]
            try:
                self._release_handles([h for h in handles if h is not None])
            except DriverError as exc:
                failed.append(exc)
            if failed:
                raise DriverError("; ".join(str(e) for e in failed)) from failed[0]
        finally:
            self._release_primary(log_errors=False)

    def _release_primary(self, log_errors: bool) -> None:
        if self._primary is None:
            return
        self._primary = None
        try:
            self.call("cuDevicePrimaryCtxRelease", self._dev)
        except DriverError as exc:
            if not log_errors:
                raise
            log.error("%s", exc)
