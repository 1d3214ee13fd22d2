"""The types both sides of the backend seam share: the KV shape and dtype tables, a cache's stats, and the data
movements an allocator decides and a storage carries out.

An allocator is bookkeeping only: when its books say data must move (copy a shared unit on write, save a sequence's
KV to the host on swap-out, write it back on swap-in, drop a saved copy), it emits one of the orders below. The
cache connects that outbox to its storage (KVCache.__post_init__), so neither side imports or holds the other; an
accounting-only cache discards the orders. Addresses in an order are the backend's own (block ids, a slot, a region
start): its allocator and storage agree on them, nobody else reads them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlab.common.kv.dtype_names import COMPUTE_DTYPE_BYTES, FP8_NAMES

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    """What the model needs stored per token: one K and one V of [num_kv_heads, head_dim] per layer."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int
    dtype: str = "float32"             # the compute dtype (q, the kernels' output)
    device: str = "cpu"
    kv_cache_dtype: str = "auto"       # auto (= dtype) | fp8_e4m3 | fp8_e5m2 (stored as 1-byte values)
    sliding_window: int | None = None  # every layer attends to its last W tokens only (Mistral); None: all

    # The torch dtypes are imported when asked for: sizing a cache (the simulator) needs no torch.
    @property
    def torch_dtype(self) -> torch.dtype:
        from kvlab.common.kv.torch_dtypes import TORCH_DTYPES
        return TORCH_DTYPES[self.dtype]

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        """The fp8 format K/V are stored in, or None when they are stored in the compute dtype."""
        from kvlab.common.kv.torch_dtypes import FP8_DTYPES
        return FP8_DTYPES.get(self.kv_cache_dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of the cache tensors: uint8 bytes holding fp8 values, else the compute dtype."""
        import torch
        return torch.uint8 if self.fp8_dtype is not None else self.torch_dtype

    @property
    def itemsize(self) -> int:
        """Bytes of one stored K or V element (1 with an fp8 cache)."""
        return 1 if self.kv_cache_dtype in FP8_NAMES else COMPUTE_DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of K (or of V) for one token in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.bytes_per_token_per_layer


@dataclass(slots=True)
class CacheStats:
    """One snapshot of a backend. Units are the backend's allocation grain (block, page group, token)."""
    backend: str
    unit_name: str
    tokens_per_unit: int
    total_units: int
    used_units: int
    free_units: int
    live_tokens: int = 0               # tokens held for live sequences
    allocated_token_slots: int = 0     # token capacity of the units those sequences hold
    reserved_bytes: int = 0            # virtual/pool bytes set aside at start-up
    mapped_bytes: int = 0              # physical bytes currently backing the cache
    num_mappings: int = 0              # host VMAs / CUDA mappings in use (vmm)
    map_calls: int = 0
    unmap_calls: int = 0
    map_seconds: float = 0.0
    unmap_seconds: float = 0.0
    cow_copies: int = 0
    prefix_hit_tokens: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    allocator_seconds: float = 0.0     # time in allocate/free/fork/swap bookkeeping and mapping
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class CopyKV:
    """Copy-on-write: `dst` gets the first `num_tokens` tokens held at `src`."""
    src: Any
    dst: Any
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SaveKV:
    """Swap-out: keep a host copy of the `num_tokens` tokens `seq_id` holds at `where`, before its units go."""
    seq_id: int
    where: Any
    num_tokens: int


@dataclass(frozen=True, slots=True)
class RestoreKV:
    """Swap-in: write `seq_id`'s host copy back at `where` (its newly taken units), then drop the copy."""
    seq_id: int
    where: Any
    num_tokens: int


@dataclass(frozen=True, slots=True)
class DropSavedKV:
    """A swapped-out sequence was freed: its host copy goes."""
    seq_id: int


KVMove = CopyKV | SaveKV | RestoreKV | DropSavedKV
MoveSink = Callable[[KVMove], None]


def discard(order: KVMove) -> None:
    """The outbox of an allocator with no storage behind it (accounting-only): nothing to move."""
