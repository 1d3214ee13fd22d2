"""The paged backend's KV handoff: the sequence's blocks (every layer, K and V) copied through shared memory, in the
storage's own layout [2, L, blocks, block_size, H_kv, D]; the decode engine allocates its own blocks and copies
them in (common/handoff/copying.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.common.handoff.copying import CopyHandoff

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence


class PagedHandoff(CopyHandoff):
    unit = "block"

    def units(self, num_tokens: int) -> int:
        return -(-num_tokens // self.allocator.block_size)

    def layout(self, units: int, num_tokens: int) -> tuple[int, ...]:
        kv = self.storage.kv
        return (2, kv.shape[1], units, *kv.shape[3:])

    def _blocks(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        blocks = self.allocator.block_table(seq)[:self.units(num_tokens)]
        return torch.tensor(blocks, dtype=torch.int64, device=self.storage.kv.device)

    def read(self, seq: Sequence, num_tokens: int, out: torch.Tensor) -> None:
        kv = self.storage.kv
        if kv.device.type == "cpu":
            torch.index_select(kv, 2, self._blocks(seq, num_tokens), out=out)
        else:
            out.copy_(kv.index_select(2, self._blocks(seq, num_tokens)))

    def write(self, seq: Sequence, num_tokens: int, src: torch.Tensor) -> None:
        self.storage.kv.index_copy_(2, self._blocks(seq, num_tokens), src.to(self.storage.kv.device))


def make(cache, config) -> PagedHandoff:
    return PagedHandoff(cache)
