"""The reserve baseline's KV handoff: the region's first tokens (every layer, K and V) copied through shared memory
as [2, L, tokens, H_kv, D]; the decode engine reserves its own region and copies them in
(common/handoff/copying.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.handoff.copying import CopyHandoff

if TYPE_CHECKING:
    import torch

    from kvlab.common.sequence import Sequence


class ReserveHandoff(CopyHandoff):
    unit = "token"

    def units(self, num_tokens: int) -> int:
        return num_tokens

    def layout(self, units: int, num_tokens: int) -> tuple[int, ...]:
        s = self.shape
        return (2, s.num_layers, num_tokens, s.num_kv_heads, s.head_dim)

    def _start(self, seq: Sequence) -> int:
        return self.allocator.regions.spans[seq.seq_id][0]

    def read(self, seq: Sequence, num_tokens: int, out: torch.Tensor) -> None:
        start, storage = self._start(seq), self.storage
        for layer in range(self.shape.num_layers):
            out[0, layer].copy_(storage.k[layer][start:start + num_tokens])
            out[1, layer].copy_(storage.v[layer][start:start + num_tokens])

    def write(self, seq: Sequence, num_tokens: int, src: torch.Tensor) -> None:
        start, storage = self._start(seq), self.storage
        for layer in range(self.shape.num_layers):
            storage.k[layer][start:start + num_tokens].copy_(src[0, layer])
            storage.v[layer][start:start + num_tokens].copy_(src[1, layer])


def make(cache, config) -> ReserveHandoff:
    return ReserveHandoff(cache)
