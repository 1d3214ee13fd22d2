"""Which virtual-memory driver backs a vmm cache: the accounting driver (no memory) for the simulator, the host
driver on cpu, the CUDA driver on cuda[:N]."""
from __future__ import annotations

import torch

from kvlab.common.errors import ConfigError
from kvlab.vmm.drivers.accounting import AccountingVirtualMemory
from kvlab.vmm.drivers.base import VirtualMemory


def make_driver(device: str, page_size: int, accounting_only: bool, pool: str | None = None,
                pool_bytes: int | None = None) -> VirtualMemory:
    """`pool`: draw physical pages from that machine-wide pool (created with `pool_bytes`)."""
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r} for the vmm backend; use cpu or cuda[:N]")
    if accounting_only:
        return AccountingVirtualMemory(page_size, merges=kind == "cpu")
    if pool is not None:
        from kvlab.vmm.drivers.pooled import PooledVirtualMemory
        return PooledVirtualMemory(pool, page_size, pool_bytes, device)
    if kind == "cpu":
        from kvlab.vmm.drivers.host import HostVirtualMemory
        return HostVirtualMemory(page_size)
    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    return CudaVirtualMemory(int(cuda_device(device).split(":")[1]), page_size)


def cuda_device(device: str) -> str:
    """cuda:N as given, or plain cuda as torch's current device (0 without a GPU)."""
    if ":" in device:
        return device
    return f"cuda:{torch.cuda.current_device() if torch.cuda.is_available() else 0}"
