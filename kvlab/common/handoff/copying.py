"""The handoff of a backend that copies: the prefill side writes the sequence's K/V into a memfd in its own layout,
the decode side allocates the sequence and copies the K/V in. A backend says what its layout is and how to read
and write it (paged/handoff.py: blocks; reserve/handoff.py: a region's tokens)."""
from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from kvlab.common.errors import HandoffError
from kvlab.common.handoff import shm
from kvlab.common.handoff.seam import Export, HandoffRefused, HandoffReport

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence


class CopyHandoff(ABC):
    unit = "unit"
    import_within_ack = False    # the memfd is a copy: it stays valid after the giver frees its own KV

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.allocator, self.storage, self.shape = cache, cache.allocator, cache.storage, cache.shape

    def describe(self) -> dict[str, Any]:
        s = self.shape
        return {"unit": self.unit, "tokens_per_unit": self.allocator.tokens_per_unit, "num_layers": s.num_layers,
                "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "cache_dtype": str(s.cache_dtype)}

    def params(self) -> dict[str, Any]:
        return {}                 # the layout check at the pull (check_peer) covers what a copy needs

    def check_params(self, kv: dict[str, Any]) -> None:
        return None

    def check_peer(self, layout: Any) -> None:
        mine = self.describe()
        if layout != mine:
            raise HandoffError(f"the decode engine's KV layout {layout} differs from this engine's {mine}: run "
                               "both roles with the same model, KV dtype and unit size")

    @abstractmethod
    def units(self, num_tokens: int) -> int:
        """Units the first `num_tokens` tokens take."""

    @abstractmethod
    def layout(self, units: int, num_tokens: int) -> tuple[int, ...]:
        """The shape of the shared tensor holding them (the storage's own layout)."""

    @abstractmethod
    def read(self, seq: Sequence, num_tokens: int, out: torch.Tensor) -> None:
        """Copy the sequence's first `num_tokens` tokens of K/V into `out`."""

    @abstractmethod
    def write(self, seq: Sequence, num_tokens: int, src: torch.Tensor) -> None:
        """Copy `src` into the sequence's storage (it holds `num_tokens` tokens already)."""

    def export(self, seq: Sequence, num_tokens: int) -> Export:
        start = time.perf_counter()
        units = self.units(num_tokens)
        shape = self.layout(units, num_tokens)
        nbytes = _nbytes(shape, self.shape.cache_dtype)
        fd = shm.create(nbytes)
        try:
            with shm.mapped(fd, shape, self.shape.cache_dtype) as out:
                self.read(seq, num_tokens, out)
        except BaseException:
            os.close(fd)
            raise
        header = {"num_tokens": num_tokens, "units": units, "shape": list(shape), "bytes": nbytes}
        return Export(header, [fd], HandoffReport(time.perf_counter() - start, nbytes, units, self.unit))

    def import_kv(self, seq: Sequence, header: Any, fds: list[int]) -> HandoffReport:
        num_tokens, units, shape = _read_header(header, fds)
        if tuple(shape) != self.layout(units, num_tokens):
            raise HandoffError(f"the KV arrived as {shape}, this engine expects {list(self.layout(units, num_tokens))}")
        if self.allocator.allocate(seq, num_tokens) is None:
            raise HandoffRefused(f"no room for {num_tokens} tokens of imported KV")
        try:
            with shm.mapped(fds[0], tuple(shape), self.shape.cache_dtype) as src:
                self.write(seq, num_tokens, src)
        except BaseException:
            self.allocator.free(seq)          # the request fails waiting, where nothing else would free it
            raise
        return HandoffReport(0.0, _nbytes(shape, self.shape.cache_dtype), units, self.unit)

    def release(self, seq: Sequence, taken: bool | None) -> None:
        """The K/V were copied out (or not): either way this engine's copy goes."""
        self.allocator.free(seq)


def _read_header(header: Any, fds: list[int]) -> tuple[int, int, list[int]]:
    try:
        num_tokens, units, shape = int(header["num_tokens"]), int(header["units"]), list(map(int, header["shape"]))
    except (TypeError, KeyError, ValueError):
        raise HandoffError(f"a malformed KV header from the prefill engine: {str(header)[:120]}") from None
    if len(fds) != 1:
        raise HandoffError(f"the KV came with {len(fds)} descriptors, 1 expected")
    return num_tokens, units, shape


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
