"""Shared memory for the copying backends: a memfd (nothing in the filesystem) sized for the K/V, mapped and seen
as one torch tensor. The prefill side writes it and passes the descriptor; the decode side maps it and reads."""
from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

import torch

from kvlab.common.errors import HandoffError


def create(nbytes: int) -> int:
    fd = os.memfd_create("kvlab-handoff", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
    except OSError as exc:
        os.close(fd)
        raise HandoffError(f"cannot make {nbytes} bytes of shared memory for the KV ({exc.strerror})") from None
    return fd


@contextlib.contextmanager
def mapped(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The memfd as a tensor of `shape`; the mapping goes when the block ends (drop other views of it first)."""
    nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    if os.fstat(fd).st_size < nbytes:
        raise HandoffError(f"the KV shared memory holds {os.fstat(fd).st_size} bytes, {nbytes} expected")
    area = mmap.mmap(fd, max(nbytes, 1))
    try:
        flat = torch.frombuffer(area, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        view = flat.view(dtype).view(shape)
        yield view
        del flat, view
    finally:
        area.close()
