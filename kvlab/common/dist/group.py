"""Process groups: the device group (gloo on CPU, NCCL on CUDA) for the all-reduces, and a gloo CPU group
for rank 0's step message, over 127.0.0.1 on a free port. Collectives time out, so a stuck rank cannot hang
the others forever; a worker dies with its parent (rank 0), so a killed driver leaves no orphan."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 120        # an all-reduce or step broadcast that takes longer means a rank is stuck
IDLE_TIMEOUT_S = 24 * 3600        # workers wait this long for rank 0's next message (the driver may idle)
PR_SET_PDEATHSIG = 1


@dataclass(slots=True)
class Groups:
    device: Any                   # all-reduces of activations
    control: Any                  # rank 0's messages (gloo, CPU objects)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> str:
    """Rank r computes on cuda:r (on CPU every rank shares the CPU)."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def init_groups(rank: int, world: int, port: int, device: str) -> Groups:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return Groups(device=dist.group.WORLD, control=control)


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this worker when rank 0's process dies, however it dies (and if rank 0 died
    before this call, the worker is already an orphan: it exits now)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:                # not Linux: rely on rank 0's teardown and the collective timeouts
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
