"""One NVIDIA GPU through `cuda.bindings.driver` (the CUDA driver API's VMM calls): every driver call goes through
`call`, which turns a raised exception and a non-zero CUresult alike into a DriverError naming the call; driver calls
use the calling thread's current context, so each thread is given the device's primary context (torch's) on first use
(cuCtxCreate is never used: it would break torch interop). `PageHandles` are the page store's physical pages, one
cuMemCreate handle each, created up front and again after a discard.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvlab.common.errors import DriverError

log = logging.getLogger("kvlab.vmm")


def import_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DriverError("cuda.bindings is not importable (pip install cuda-python); the cuda VMM driver needs "
                          f"it: {exc}") from exc
    return driver


def cuda_index(device: str) -> int:
    """N of cuda:N, or for plain cuda torch's current device (0 without a GPU)."""
    if ":" in device:
        return int(device.split(":")[1])
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def as_int(handle: Any) -> int:
    """CUdeviceptr / CUcontext / handle objects -> int (None and NULL -> 0)."""
    return 0 if handle is None else int(handle)


class CudaDevice:
    """The checked driver calls of one device, its primary context and the properties of its allocations."""

    def __init__(self, device: int, driver: Any = None) -> None:
        self.drv = driver if driver is not None else import_driver()
        self.device = device
        self._local = threading.local()
        self._primary: Any = None
        if driver is None and torch.cuda.is_available():
            torch.cuda.init()   # torch owns (and creates) the primary context first
        try:
            self._open(device)
        except BaseException:
            self.release_primary(log_errors=True)
            raise

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

    def _open(self, device: int) -> None:
        drv = self.drv
        self.call("cuInit", 0)
        self._dev = self.call("cuDeviceGet", device)
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
        if not self.call("cuDeviceGetAttribute", attr, self._dev):
            raise DriverError(f"device {device} does not support CUDA virtual memory management; use the paged "
                              "backend")
        self._primary = self.call("cuDevicePrimaryCtxRetain", self._dev)
        self.ensure_context()
        self.prop = self._allocation_prop()
        self.access = [self._access_desc()]
        option = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(self.call("cuMemGetAllocationGranularity", self.prop, option))

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

    def rounded_page_size(self, requested: int | None) -> int:
        """`requested` (None: the granularity) rounded up to a multiple of the granularity (logged if changed)."""
        g = self.granularity
        size = -(-(requested or g) // g) * g
        if requested and size != requested:
            log.warning("page_size %d is not a multiple of device %d's allocation granularity %d; using %d",
                        requested, self.device, g, size)
        return size

    def ensure_context(self) -> None:
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

    def release_primary(self, log_errors: bool) -> None:
        if self._primary is None:
            return
        self._primary = None
        try:
            self.call("cuDevicePrimaryCtxRelease", self._dev)
        except DriverError as exc:
            if not log_errors:
                raise
            log.error("%s", exc)


def release_handles(cuda: CudaDevice, handles: list[int]) -> None:
    """cuMemRelease every handle; then report the failures, if any, in one DriverError."""
    failed: list[DriverError] = []
    for h in handles:
        try:
            cuda.call("cuMemRelease", h)
        except DriverError as exc:
            failed.append(exc)
    if failed:
        raise DriverError(f"{len(failed)} of {len(handles)} cuMemRelease calls failed (first: {failed[0]})"
                          ) from failed[0]


class PageHandles:
    """Pool page -> its cuMemCreate handle (None: discarded, created again when next mapped)."""

    def __init__(self, cuda: CudaDevice, page_size: int) -> None:
        self.cuda, self.page_size = cuda, page_size
        self.handles: list[int | None] = []

    def resize(self, old_pages: int, new_pages: int) -> None:
        if new_pages > old_pages:
            created = []
            try:
                for _ in range(new_pages - old_pages):
                    created.append(self._create())
            except BaseException:
                self.release(created)
                raise
            self.handles.extend(created)
        else:
            cut = self.handles[new_pages:]
            del self.handles[new_pages:]
            self.release([h for h in cut if h is not None])

    def _create(self) -> int:
        return as_int(self.cuda.call("cuMemCreate", self.page_size, self.cuda.prop, 0))

    def get(self, page: int) -> int:
        if self.handles[page] is None:   # discarded earlier: create it again
            self.handles[page] = self._create()
        return self.handles[page]

    def discard(self, first_page: int, num_pages: int) -> None:
        gone = [h for h in self.handles[first_page:first_page + num_pages] if h is not None]
        self.handles[first_page:first_page + num_pages] = [None] * num_pages
        self.release(gone)

    def release(self, handles: list[int]) -> None:
        release_handles(self.cuda, handles)

    def close(self, store_maps: Sequence[int]) -> None:
        """Release every handle (a handle still mapped after a failed unmap is freed when that unmap happens:
        the driver frees a released handle's memory once no mapping uses it; only after a successful synchronise,
        since kernels may still read it)."""
        handles, self.handles = self.handles, []
        mapped = {h for p, h in enumerate(handles) if h is not None and store_maps[p]}
        failed: list[DriverError] = []
        if mapped:
            try:
                self.cuda.call("cuCtxSynchronize")
            except DriverError as exc:
                failed.append(DriverError(f"{len(mapped)} handle(s) still mapped are not released: {exc}"))
                handles = [h for h in handles if h not in mapped]
        try:
            self.release([h for h in handles if h is not None])
        except DriverError as exc:
            failed.append(exc)
        if failed:
            raise DriverError("; ".join(str(e) for e in failed)) from failed[0]
