"""Shared memory for the copying backends: a memfd (nothing in the filesystem) sized for the K/V, mapped and seen
as one torch tensor. The prefill side writes it and passes the descriptor; the decode side maps it and reads. The
memfd's size is sealed once made, and checked with its seals before any mapping (common/memfd.py), so a shrink by
either side cannot SIGBUS the other."""
from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator

import torch

from kvlab.common import memfd
from kvlab.common.errors import HandoffError


def create(nbytes: int) -> int:
    try:
        return memfd.sealed("kvlab-handoff", max(nbytes, 1))
    except OSError as exc:
        raise HandoffError(f"cannot make {nbytes} bytes of shared memory for the KV ({exc.strerror})") from None


@contextlib.contextmanager
def mapped(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The memfd as a tensor of `shape`; the mapping goes when the block ends (drop other views of it first)."""
    nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    try:
        memfd.check(fd, nbytes, "the KV shared memory")
    except memfd.UnsafeMemfd as exc:
        raise HandoffError(str(exc)) from None
    area = mmap.mmap(fd, max(nbytes, 1))
    try:
        flat = torch.frombuffer(area, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        view = flat.view(dtype).view(shape)
        yield view
        del flat, view
    finally:
        area.close()
