"""A zero-copy uint8 tensor over raw memory through DLPack, with the device stated: torch never asks the driver
where the pointer lives.

`__cuda_array_interface__` makes torch call `cudaPointerGetAttributes` on the pointer, which can fail on a
reservation whose first page is not mapped yet (issue 18). A DLPack capsule names its device (kDLCUDA + index),
so torch builds the tensor from that alone. The capsule's deleter runs when the last tensor sharing the memory
is gone; it drops the `holder`, so a `weakref.finalize` on the holder tells when no view is left.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

KDL_CPU, KDL_CUDA = 1, 2
KDL_UINT = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", Deleter)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_incref, _decref = ctypes.pythonapi.Py_IncRef, ctypes.pythonapi.Py_DecRef
_incref.argtypes = _decref.argtypes = [ctypes.py_object]


@Deleter
def _delete(managed: Any) -> None:
    """torch is done with the memory: drop the reference `capsule` took on (struct, shape, holder)."""
    _decref(ctypes.cast(managed.contents.manager_ctx, ctypes.py_object).value)


def capsule(ptr: int, nbytes: int, device_type: int, device_index: int, holder: Any) -> Any:
    """A "dltensor" PyCapsule: `nbytes` uint8 at `ptr` on the given device; keeps `holder` alive until deleted."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(ptr, DLDevice(device_type, device_index), 1, DLDataType(KDL_UINT, 8, 1), shape,
                                 None, 0)
    managed.deleter = _delete
    keep = (managed, shape, holder)   # what must outlive the tensor: released by _delete
    _incref(keep)
    managed.manager_ctx = id(keep)
    return _capsule_new(ctypes.addressof(managed), b"dltensor", None)


def byte_tensor(ptr: int, nbytes: int, device: torch.device, holder: Any) -> torch.Tensor:
    """A zero-copy uint8 tensor over [ptr, +nbytes) on `device` (cpu or cuda:N, index required); reads no memory
    and queries nothing about the pointer."""
    if device.type == "cuda" and device.index is None:
        raise ValueError("byte_tensor needs an explicit cuda device index (cuda:N)")
    kind = {"cpu": KDL_CPU, "cuda": KDL_CUDA}[device.type]
    return torch.from_dlpack(capsule(ptr, nbytes, kind, device.index or 0, holder))

