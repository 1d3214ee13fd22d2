"""How the vmm cache is laid out: page size, pages per slot, slots and page groups.

Per layer, K and V are virtual tensors [num_slots, max_len, H_kv, D] (2L tensors in all); a slot is one row
of every tensor, `pages_per_slot` pages long. A page group (the cache's unit) is one page in each tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.common.errors import ConfigError

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.types import KVShape


@dataclass(frozen=True, slots=True)
class Geometry:
    page_size: int
    tokens_per_page: int
    pages_per_slot: int
    num_slots: int
    num_tensors: int              # 2L: K_0..K_{L-1}, V_0..V_{L-1}
    num_groups: int               # G: capacity in units

    @property
    def max_len(self) -> int:
        return self.pages_per_slot * self.tokens_per_page

    @property
    def row_bytes(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def tensor_bytes(self) -> int:
        return self.num_slots * self.row_bytes

    def pages_for(self, tokens: int) -> int:
        """Pages (per tensor) that hold `tokens` tokens."""
        return -(-tokens // self.tokens_per_page)


def make_geometry(config: EngineConfig, shape: KVShape, page_size: int) -> Geometry:
    per_token = shape.bytes_per_token_per_layer
    if page_size < per_token:
        raise ConfigError(f"page_size {page_size} B is smaller than one token's K for one layer ({per_token} B); "
                          "raise page_size")
    tpp = page_size // per_token
    tensors = 2 * shape.num_layers
    groups = config.kv_cache_bytes // (tensors * page_size)
    if groups < 1:
        raise ConfigError(f"kv_cache_bytes {config.kv_cache_bytes} holds no page group ({tensors} tensors x "
                          f"{page_size} B pages); raise kv_cache_bytes or lower page_size")
    return Geometry(page_size, tpp, -(-config.max_model_len // tpp), config.max_num_seqs, tensors, groups)

