"""The CUDA driver as the GPU check uses it: cuda.bindings.driver, or in a CPU dry run the recording fake
(tests/fakes/fake_cuda.py, loaded from the source tree: the library holds no test code), with checked calls and
the primary context (the one torch uses) current on the creating thread.
Used directly, not through vmm's internals, so a reorganisation of vmm does not break it."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError

MiB = 2**20


def driver_module(dry: bool) -> Any:
    """The real cuda.bindings.driver, or a fresh recording fake of it for the dry run."""
    if dry:
        return fake_driver()
    return importlib.import_module("cuda.bindings.driver")


def fake_driver() -> Any:
    """A fresh recording fake of cuda.bindings.driver from the source tree's tests/fakes/ (the dry run is a check of
    a checkout, like the tests; an installed kvlab has no tests and says so)."""
    tests = Path(__file__).resolve().parents[3] / "tests"
    if not (tests / "fakes" / "fake_cuda.py").is_file():
        raise ConfigError(f"--dry-run-cpu needs the recording fake driver of a source checkout ({tests}/fakes/"
                          "fake_cuda.py is missing); run it from a kvlab checkout")
    if str(tests) not in sys.path:
        sys.path.append(str(tests))
    return importlib.import_module("fakes.fake_cuda").FakeCudaDriver()


def allocation_prop(drv: Any) -> Any:
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    return prop


def access_desc(drv: Any) -> Any:
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


class DriverCallError(RuntimeError):
    def __init__(self, name: str, result: str) -> None:
        super().__init__(f"{name} returned {result}")
        self.result = result


class Driver:
    """Checked driver calls with the primary context current on the creating thread."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.drv = driver_module(dry)
        self.call("cuInit", 0)
        self.dev = self.call("cuDeviceGet", 0)
        self.ctx = self.call("cuDevicePrimaryCtxRetain", self.dev)
        self.call("cuCtxSetCurrent", self.ctx)
        self.prop = allocation_prop(self.drv)
        self.access = [access_desc(self.drv)]

    def call(self, name: str, *args: Any) -> Any:
        err, *values = getattr(self.drv, name)(*args)
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise DriverCallError(name, getattr(err, "name", str(err)))
        return values[0] if len(values) == 1 else (values or None)

    def granularity(self, which: str) -> int:
        flag = getattr(self.drv.CUmemAllocationGranularity_flags, f"CU_MEM_ALLOC_GRANULARITY_{which}")
        return int(self.call("cuMemGetAllocationGranularity", self.prop, flag))

    def reserve(self, size: int) -> int:
        return int(self.call("cuMemAddressReserve", size, 0, 0, 0))

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self.call("cuMemMap", ptr, size, 0, handle, 0)
        self.call("cuMemSetAccess", ptr, size, self.access, 1)

    def close(self) -> None:
        self.call("cuDevicePrimaryCtxRelease", self.dev)


def mem_free(dry: bool) -> int | None:
    """Free device bytes (torch.cuda.mem_get_info); None in a dry run."""
    if dry:
        return None
    import torch
    return torch.cuda.mem_get_info()[0]


def host_bytes(d: Driver, ptr: int, n: int) -> bytes:
    """n bytes from device address ptr, copied by the driver (no torch tensor over the address)."""
    import numpy as np
    buf = np.zeros(n, dtype=np.uint8)
    d.call("cuMemcpyDtoH", buf.ctypes.data, ptr, n)
    return buf.tobytes()


def to_device(d: Driver, ptr: int, data: bytes) -> None:
    import numpy as np
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    d.call("cuMemcpyHtoD", ptr, buf.ctypes.data, len(data))


class ArrayInterface:
    """A bare __cuda_array_interface__ over a device address, as a VMM cache hands torch its views."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}
