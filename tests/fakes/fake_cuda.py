"""A recording fake of `cuda.bindings.driver` for the VMM calls (docs/gpu-contracts.md §1.1-1.3), for machines
without a GPU: the tests drive vmm/drivers/cuda.py against it, and so does the GPU check's CPU dry run
(experiments/gpu/).

Like the real module every cuXxx returns a tuple `(CUresult, *values)`; structs and enums are the real ones from
cuda.bindings (they work without a driver). It enforces the documented rules: cuInit first; a current context on the
calling thread for memory calls; flags 0; sizes/addresses/offsets multiples of the MINIMUM granularity of the prop
given; cuMemSetAccess takes a list and a fully mapped range; unmap covers whole mappings; cuMemAddressFree takes
exactly a reservation with nothing mapped in it; an allocation exports as a POSIX file descriptor only if it was
created with that requestedHandleType, imports only from one, and its memory goes only when every handle to it (its
imports included) is released and nothing maps it (fake_cuda_state.py). Errors the real driver returns come back as
CUresults; misuse the real driver would NOT catch (cuCtxCreate, unmapping while kernels may still run, i.e. without
a cuCtxSynchronize since access was granted) raises AssertionError.

Physical memory is never zeroed (cuMemCreate memory is not): each handle's bytes are garbage, drawn from the
handle's number, and `read(ptr, n)` returns what a mapped address holds (`write(ptr, data)`: a kernel's write).
`cuPointerGetAttribute` fails on an address no mapping covers, as the real one does on an unmapped reservation;
`torch_interop` makes torch's CUDA tensor factories behave as they do on a GPU (docs/gpu-contracts.md §1.4), so a
view over a reservation built through a pointer query fails here as it would there.

`calls` records (name, thread id) in order; `fail(name, ...)` injects a CUresult or an exception; `leaks()` lists
what was acquired and not given back."""
from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any

import torch
from cuda.bindings import driver as _real

from fakes.fake_cuda_state import POSIX_FD, CallLog, Contexts, DeviceMemory, Mapping

CUresult = _real.CUresult
CUdevice = _real.CUdevice
CUcontext = _real.CUcontext
CUdeviceptr = _real.CUdeviceptr
CUmemGenericAllocationHandle = _real.CUmemGenericAllocationHandle
CUmemAllocationProp = _real.CUmemAllocationProp
CUmemAccessDesc = _real.CUmemAccessDesc
CUmemAllocationType = _real.CUmemAllocationType
CUmemLocationType = _real.CUmemLocationType
CUmemAllocationHandleType = _real.CUmemAllocationHandleType
CUmemAllocationGranularity_flags = _real.CUmemAllocationGranularity_flags
CUmemAccess_flags = _real.CUmemAccess_flags
CUdevice_attribute = _real.CUdevice_attribute
CUpointer_attribute = _real.CUpointer_attribute

OK = CUresult.CUDA_SUCCESS
INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE
OUT_OF_MEMORY = CUresult.CUDA_ERROR_OUT_OF_MEMORY
NOT_INITIALIZED = CUresult.CUDA_ERROR_NOT_INITIALIZED
INVALID_DEVICE = CUresult.CUDA_ERROR_INVALID_DEVICE
INVALID_CONTEXT = CUresult.CUDA_ERROR_INVALID_CONTEXT
MiB = 1024 * 1024


class FakeDeviceCalls:
    """The cu* calls of init, devices and contexts (FakeCudaDriver's first part); the state is the driver's:
    `log`, `ctx`, `num_devices`, `vmm_supported`, `current`, `primary_retains`, `primary_context`."""

    def cuInit(self, flags: int):
        if (r := self.log.enter("cuInit")) is not None:
            return r
        if flags != 0:
            return (INVALID_VALUE,)
        self.ctx.initialized = True
        return (OK,)

    def cuDeviceGet(self, ordinal: int):
        if (r := self.log.enter("cuDeviceGet")) is not None:
            return r + (None,)
        if not self.ctx.initialized:
            return (NOT_INITIALIZED, None)
        if not 0 <= ordinal < self.num_devices:
            return (INVALID_DEVICE, None)
        return (OK, CUdevice(ordinal))

    def cuDeviceGetAttribute(self, attrib: Any, dev: Any):
        if (r := self.log.enter("cuDeviceGetAttribute")) is not None:
            return r + (None,)
        if attrib == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED:
            return (OK, int(self.vmm_supported))
        return (OK, 0)

    def cuDevicePrimaryCtxRetain(self, dev: Any):
        if (r := self.log.enter("cuDevicePrimaryCtxRetain")) is not None:
            return r + (None,)
        if not self.ctx.initialized:
            return (NOT_INITIALIZED, None)
        d = int(dev)
        self.primary_retains[d] = self.primary_retains.get(d, 0) + 1
        return (OK, CUcontext(self.primary_context(d)))

    def cuDevicePrimaryCtxRelease(self, dev: Any):
        if (r := self.log.enter("cuDevicePrimaryCtxRelease")) is not None:
            return r
        d = int(dev)
        if not self.primary_retains.get(d):
            return (INVALID_CONTEXT,)
        self.primary_retains[d] -= 1
        return (OK,)

    def cuCtxGetCurrent(self):
        if (r := self.log.enter("cuCtxGetCurrent")) is not None:
            return r + (None,)
        if not self.ctx.initialized:
            return (NOT_INITIALIZED, None)
        return (OK, CUcontext(self.current.get(threading.get_ident(), 0)))

    def cuCtxSetCurrent(self, ctx: Any):
        if (r := self.log.enter("cuCtxSetCurrent")) is not None:
            return r
        c = int(ctx)
        if c and not self.ctx.is_retained(c):
            return (INVALID_CONTEXT,)
        self.current[threading.get_ident()] = c
        return (OK,)

    def cuCtxCreate(self, *args: Any):
        self.log.enter("cuCtxCreate")
        raise AssertionError("cuCtxCreate makes a second context and breaks torch interop; use the primary context")

    def cuCtxSynchronize(self):
        if (r := self.log.enter("cuCtxSynchronize")) is not None:
            return r
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        self.ctx.work_pending = False
        return (OK,)


class FakeCudaDriver(FakeDeviceCalls):
    """The cu* calls over three parts (fake_cuda_state.py); the parts' state and test controls are exposed as
    attributes, so tests read `fake.mappings` or call `fake.fail(...)` as before."""
    # the real module's types, so code written against `driver.X` works unchanged
    CUresult, CUdevice, CUcontext, CUdeviceptr = CUresult, CUdevice, CUcontext, CUdeviceptr
    CUmemGenericAllocationHandle, CUmemAllocationProp, CUmemAccessDesc = (
        CUmemGenericAllocationHandle, CUmemAllocationProp, CUmemAccessDesc)
    CUmemAllocationType, CUmemLocationType, CUmemAllocationHandleType = (
        CUmemAllocationType, CUmemLocationType, CUmemAllocationHandleType)
    CUmemAllocationGranularity_flags, CUmemAccess_flags, CUdevice_attribute = (
        CUmemAllocationGranularity_flags, CUmemAccess_flags, CUdevice_attribute)
    CUpointer_attribute = CUpointer_attribute

    def __init__(self, granularity: int = 2 * MiB, num_devices: int = 1, memory_bytes: int = 1 << 34,
                 vmm_supported: bool = True, log: CallLog | None = None) -> None:
        """`log`: the call log to record into (a test's own subclass can fail calls its way)."""
        self.log, self.ctx = log or CallLog(), Contexts()
        self.mem = DeviceMemory(granularity, num_devices, memory_bytes)
        self.granularity, self.num_devices, self.memory_bytes = granularity, num_devices, memory_bytes
        self.vmm_supported = vmm_supported
        self.calls, self.failures = self.log.calls, self.log.failures
        self.fail, self.names = self.log.fail, self.log.names
        self.current, self.primary_retains = self.ctx.current, self.ctx.primary_retains
        self.primary_context, self.launch = self.ctx.primary_context, self.ctx.launch
        self.reservations, self.handles, self.mappings = self.mem.reservations, self.mem.handles, self.mem.mappings
        self.memory, self.read, self.write = self.mem.memory, self.mem.read, self.mem.write

    def leaks(self) -> dict[str, Any]:
        out = {"reservations": dict(self.reservations), "handles": dict(self.handles),
               "mappings": sorted(self.mappings), "primary_retains": {d: n for d, n in self.primary_retains.items()
                                                                     if n}}
        return {k: v for k, v in out.items() if v}

    # -- virtual memory -----------------------------------------------------------------------------------
    def cuMemGetAllocationGranularity(self, prop: Any, option: Any):
        if (r := self.log.enter("cuMemGetAllocationGranularity")) is not None:
            return r + (None,)
        if (err := self.ctx.need_context()) is not None:
            return (err, None)
        if not self.mem.valid_prop(prop):
            return (INVALID_VALUE, None)
        return (OK, self.granularity)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int):
        if (r := self.log.enter("cuMemAddressReserve")) is not None:
            return r + (None,)
        if (err := self.ctx.need_context()) is not None:
            return (err, None)
        if flags != 0 or size <= 0 or not self.mem.aligned(size, alignment):
            return (INVALID_VALUE, None)
        return (OK, CUdeviceptr(self.mem.reserve(size)))

    def cuMemAddressFree(self, ptr: Any, size: int):
        if (r := self.log.enter("cuMemAddressFree")) is not None:
            return r
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        p = int(ptr)
        if self.reservations.get(p) != size or self.mem.mapped_in(p, size):
            return (INVALID_VALUE,)
        del self.reservations[p]
        return (OK,)

    def cuMemCreate(self, size: int, prop: Any, flags: int):
        if (r := self.log.enter("cuMemCreate")) is not None:
            return r + (None,)
        if (err := self.ctx.need_context()) is not None:
            return (err, None)
        if flags != 0 or size <= 0 or not self.mem.aligned(size) or not self.mem.valid_prop(prop):
            return (INVALID_VALUE, None)
        if self.mem.allocated_bytes() + size > self.memory_bytes:
            return (OUT_OF_MEMORY, None)
        exportable = prop.requestedHandleTypes == POSIX_FD
        return (OK, CUmemGenericAllocationHandle(self.mem.create(size, exportable)))

    def cuMemRelease(self, handle: Any):
        if (r := self.log.enter("cuMemRelease")) is not None:
            return r
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        h = int(handle)
        if h not in self.handles:
            return (INVALID_VALUE,)
        if any(m.handle == h for m in self.mappings.values()):
            assert not self.ctx.work_pending, "cuMemRelease of a mapped handle while kernels may run: synchronise first"
        self.mem.release(h)   # a still-mapped handle's memory is freed when it is unmapped
        return (OK,)

    # -- sharing an allocation between processes (POSIX file descriptors) ------------------------------------
    def cuMemExportToShareableHandle(self, handle: Any, handleType: Any, flags: int):
        """A new descriptor of the allocation (the caller closes it); only for allocations created exportable."""
        if (r := self.log.enter("cuMemExportToShareableHandle")) is not None:
            return r + (None,)
        if (err := self.ctx.need_context()) is not None:
            return (err, None)
        alloc = self.mem.alloc_of.get(int(handle)) if int(handle) in self.handles else None
        if flags != 0 or alloc is None or handleType != POSIX_FD or alloc.fd is None:
            return (INVALID_VALUE, None)
        return (OK, os.dup(alloc.fd))

    def cuMemImportFromShareableHandle(self, osHandle: Any, shHandleType: Any):
        """A new handle to the allocation behind the descriptor (which stays the caller's to close)."""
        if (r := self.log.enter("cuMemImportFromShareableHandle")) is not None:
            return r + (None,)
        if (err := self.ctx.need_context()) is not None:
            return (err, None)
        if shHandleType != POSIX_FD:
            return (INVALID_VALUE, None)
        try:
            return (OK, CUmemGenericAllocationHandle(self.mem.import_fd(int(osHandle))))
        except OSError:          # not an open descriptor
            return (INVALID_VALUE, None)

    def cuMemcpyDtoH(self, dstHost: Any, srcDevice: Any, ByteCount: int):
        """Copy mapped device memory to the host address `dstHost` (an int)."""
        if (r := self.log.enter("cuMemcpyDtoH")) is not None:
            return r
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        p = int(srcDevice)
        inside = self.mem.mapped_in(p, ByteCount)
        if not inside or any(not self.mappings[q].accessible for q in inside):
            return (INVALID_VALUE,)
        ctypes.memmove(int(dstHost), self.mem.read(p, ByteCount), ByteCount)
        return (OK,)

    def cuMemsetD8(self, dstDevice: Any, uc: int, N: int):
        if (r := self.log.enter("cuMemsetD8")) is not None:
            return r
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        p = int(dstDevice)
        inside = self.mem.mapped_in(p, N)
        if not inside or any(not self.mappings[q].accessible for q in inside):
            return (INVALID_VALUE,)
        self.mem.write(p, bytes([uc]) * N)
        self.ctx.work_pending = True
        return (OK,)

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int):
        if (r := self.log.enter("cuMemMap")) is not None:
            return r
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        p, h = int(ptr), int(handle)
        if flags != 0 or not self.mem.aligned(p, size, offset) or size <= 0:
            return (INVALID_VALUE,)
        if h not in self.handles or offset + size > self.handles[h]:
            return (INVALID_VALUE,)
        if self.mem.reservation_of(p, size) is None or self.mem.mapped_in(p, size):
            return (INVALID_VALUE,)
        self.mappings[p] = Mapping(size, h, offset=offset)
        return (OK,)

    def cuMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int):
        if (r := self.log.enter("cuMemSetAccess")) is not None:
            return r
        if not isinstance(desc, (list, tuple)):
            raise TypeError(f"Argument 'desc' is not instance of type (expected <class 'list'>, found "
                            f"<class '{type(desc).__name__}'>): not iterable")
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        p = int(ptr)
        if count != len(desc) or not self.mem.aligned(p, size) or size <= 0:
            return (INVALID_VALUE,)
        for d in desc:
            if d.location.type != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE \
                    or d.flags != CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
                return (INVALID_VALUE,)
        inside = self.mem.mapped_in(p, size)
        if sum(self.mappings[q].size for q in inside) != size or any(q < p for q in inside):
            return (INVALID_VALUE,)   # the range must be fully mapped
        for q in inside:
            self.mappings[q].accessible = True
        self.ctx.work_pending = True
        return (OK,)

    def cuMemUnmap(self, ptr: Any, size: int):
        if (r := self.log.enter("cuMemUnmap")) is not None:
            return r
        if (err := self.ctx.need_context()) is not None:
            return (err,)
        p = int(ptr)
        inside = self.mem.mapped_in(p, size)
        if not inside or any(q < p or q + self.mappings[q].size > p + size for q in inside):
            return (INVALID_VALUE,)   # unmap covers whole mappings only
        assert not self.ctx.work_pending, "cuMemUnmap while kernels may still read the pages: cuCtxSynchronize first"
        for q in inside:
            self.mem.unmapped(self.mappings.pop(q).handle)
        return (OK,)

    # -- pointer queries ----------------------------------------------------------------------------------
    def cuPointerGetAttribute(self, attribute: Any, ptr: Any):
        """Only mapped memory has attributes: on a bare reservation the real driver fails too."""
        if (r := self.log.enter("cuPointerGetAttribute")) is not None:
            return r + (None,)
        if (err := self.ctx.need_context()) is not None:
            return (err, None)
        if not self.mem.mapped_in(int(ptr), 1):
            return (INVALID_VALUE, None)
        if attribute == CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
            return (OK, 0)
        return (OK, int(ptr))


def _dlpack_device(capsule: Any) -> tuple[int, int, int]:
    """(device type, device index, bytes) of a one-dimensional uint8 "dltensor" capsule, read without consuming it."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # DLManagedTensor starts with DLTensor: data, device {type, id}, ndim, dtype {code, bits, lanes}, shape
    words = ctypes.cast(get(capsule, b"dltensor"), ctypes.POINTER(ctypes.c_int32))
    shape = ctypes.cast(get(capsule, b"dltensor") + 24, ctypes.POINTER(ctypes.POINTER(ctypes.c_int64))).contents
    return words[2], words[3], shape[0]


def _release_capsule(capsule: Any) -> None:
    """What torch does when the last tensor over a capsule's memory goes: call the producer's deleter."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"dltensor")
    deleter = ctypes.cast(address + 48 + 8, ctypes.POINTER(ctypes.CFUNCTYPE(None, ctypes.c_void_p))).contents
    deleter(address)


def torch_interop(monkeypatch: Any, fake: FakeCudaDriver) -> None:
    """Make torch.as_tensor and torch.from_dlpack treat CUDA memory as torch does on a GPU, returning meta tensors:
    `__cuda_array_interface__` makes torch query the pointer (`cudaPointerGetAttributes`: here the fake's
    cuPointerGetAttribute), which fails on an unmapped reservation; a kDLCUDA capsule states its device, so nothing
    is queried. The capsule's deleter runs when the returned tensor is collected."""
    as_tensor, from_dlpack = torch.as_tensor, torch.from_dlpack

    def fake_as_tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        cai = getattr(data, "__cuda_array_interface__", None)
        if cai is None:
            return as_tensor(data, *args, **kwargs)
        err, _ = fake.cuPointerGetAttribute(CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cai["data"][0])
        if int(err) != 0:
            raise RuntimeError(f"CUDA error: invalid argument (cudaPointerGetAttributes on {cai['data'][0]:#x})")
        return torch.empty(cai["shape"], dtype=torch.uint8, device="meta")

    def fake_from_dlpack(capsule: Any) -> torch.Tensor:
        kind, _, nbytes = _dlpack_device(capsule)
        if kind != 2:   # kDLCUDA
            return from_dlpack(capsule)
        tensor = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        weakref.finalize(tensor, _release_capsule, capsule)
        return tensor

    monkeypatch.setattr(torch, "as_tensor", fake_as_tensor)
    monkeypatch.setattr(torch, "from_dlpack", fake_from_dlpack)
