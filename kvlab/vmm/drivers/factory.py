"""Which virtual-memory driver backs a vmm cache: the accounting driver (no memory) for the simulator, the host
driver on cpu, the CUDA driver on cuda[:N]."""
from __future__ import annotations

from kvlab.common.errors import ConfigError
from kvlab.vmm.drivers.accounting import AccountingVirtualMemory
from kvlab.vmm.drivers.base import VirtualMemory


def make_driver(device: str, page_size: int, accounting_only: bool, pool: str | None = None,
                pool_bytes: int | None = None, backend: str = "vmm") -> VirtualMemory:
    """`pool`: draw physical pages from that machine-wide pool (created with `pool_bytes`), named in its books
    after `backend`."""
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r} for the vmm backend; use cpu or cuda[:N]")
    if accounting_only:
        return AccountingVirtualMemory(page_size, merges=kind == "cpu")
    if pool is not None:
        from kvlab.vmm.drivers.pooled import PooledVirtualMemory
        return PooledVirtualMemory(pool, page_size, pool_bytes, device, backend=backend)
    if kind == "cpu":
        from kvlab.vmm.drivers.host import HostVirtualMemory
        return HostVirtualMemory(page_size)
    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    from kvlab.vmm.drivers.cuda_device import cuda_index
    return CudaVirtualMemory(cuda_index(device), page_size)
