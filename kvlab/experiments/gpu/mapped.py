"""A torch tensor over memory the driver maps in 2 MiB pages (as a vmm cache holds its K/V), for the GPU check's
timing parts; in the CPU dry run a plain host tensor (a CPU torch cannot wrap device memory)."""
from __future__ import annotations

from typing import Any

import torch

from kvlab.experiments.gpu.driver import ArrayInterface, Driver


class MappedTensor:
    """`shape` elements of `dtype` over a reservation mapped page by page (one cuMemCreate and one
    cuMemMap + cuMemSetAccess per page of the MINIMUM granularity); close() gives everything back."""

    def __init__(self, d: Driver | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.d, self.handles, self.base, self.size = d, [], 0, 0
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if d is None:
            self.tensor = torch.empty(shape, dtype=dtype)
            return
        page = d.granularity("MINIMUM")
        self.page, self.size = page, -(-nbytes // page) * page
        self.base = d.reserve(self.size)
        for offset in range(0, self.size, page):
            self.handles.append(d.call("cuMemCreate", page, d.prop, 0))
            d.map(self.base + offset, page, self.handles[-1])
        raw = torch.as_tensor(ArrayInterface(self.base, self.size), device="cuda:0")
        self.tensor = raw[:nbytes].view(dtype).view(shape)

    @property
    def pages(self) -> int:
        return len(self.handles)

    def close(self) -> None:
        if self.d is None:
            return
        del self.tensor
        torch.cuda.synchronize()
        for i, handle in enumerate(self.handles):
            self.d.call("cuMemUnmap", self.base + i * self.page, self.page)
            self.d.call("cuMemRelease", handle)
        self.d.call("cuMemAddressFree", self.base, self.size)
        self.handles = []


def mapped(d: Driver | None, shape: tuple[int, ...], dtype: Any, into: list[MappedTensor]) -> torch.Tensor:
    """A MappedTensor's tensor, its owner kept in `into` for closing."""
    into.append(MappedTensor(d, shape, dtype))
    return into[-1].tensor
