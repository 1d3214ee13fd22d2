"""The seam between the scheduler/runner and a KV-cache backend.

The scheduler only uses the capacity and lifecycle methods; the runner only uses `prepare` and the model
only `attention`. Neither ever asks which backend it talks to. Every backend has two modes built on one
allocation logic: real (tensors on a device) and accounting-only (no memory; the simulator's mode).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvlab.common.attention.metadata import AttentionMetadata, BatchItem
    from kvlab.common.config import EngineConfig
    from kvlab.common.sequence import Sequence

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class KVShape:
    """What the model needs stored per token: one K and one V of [num_kv_heads, head_dim] per layer."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=self.torch_dtype).element_size()

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


class KVCache(ABC):
    """The backend interface. Capacity is counted in units of `tokens_per_unit` tokens."""

    name: str = "abstract"
    unit_name: str = "unit"
    tokens_per_unit: int = 1

    def __init__(self, config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> None:
        self.config = config
        self.shape = shape
        self.accounting_only = accounting_only

    # -- capacity -------------------------------------------------------------------------------------
    @abstractmethod
    def num_total_units(self) -> int: ...

    @abstractmethod
    def num_free_units(self) -> int: ...

    @abstractmethod
    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra units `seq` needs to hold `num_tokens` tokens (0 if it already can)."""

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> bool:
        """True if `seq` can grow to `num_tokens` and still leave `reserve_units` free (the watermark).
        Backends with slots (vmm, reserve) also refuse when no slot is available."""
        return self.units_needed(seq, num_tokens) + reserve_units <= self.num_free_units()

    def max_tokens_per_seq(self) -> int:
        """The longest sequence this cache could ever hold alone (for "can never fit" errors)."""
        return self.num_total_units() * self.tokens_per_unit

    # -- lifecycle ------------------------------------------------------------------------------------
    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Make `seq` hold `num_tokens` tokens; raises OutOfKVCache. Returns how many leading tokens are
        already present from a prefix-cache hit (0 without prefix caching) on the first allocation."""

    @abstractmethod
    def free(self, seq: Sequence) -> None: ...

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every unit of the parent; a shared partial unit is copied on the child's write."""

    @abstractmethod
    def swap_out(self, seq: Sequence) -> None:
        """Copy seq's KV to host memory and release its units."""

    @abstractmethod
    def swap_in(self, seq: Sequence) -> None:
        """Allocate units again and restore seq's KV from host memory; raises OutOfKVCache."""

    def can_swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        return self.can_allocate(seq, seq.num_computed_tokens, reserve_units)

    @abstractmethod
    def holds(self, seq: Sequence) -> bool:
        """Whether the cache holds KV for `seq` resident in the cache: True from its first `allocate` (or
        `fork`, or `swap_in`) until `free` or `swap_out`. A swapped-out sequence is not held (its host copy
        is the swap's business: `free` drops it, `swap_in` restores it)."""

    # -- one step -------------------------------------------------------------------------------------
    @abstractmethod
    def prepare(self, items: list[BatchItem]) -> AttentionMetadata:
        """Build this step's attention metadata. Every item's seq must already hold context_len tokens."""

    @abstractmethod
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write k, v ([T, H_kv, D]) for this step's tokens into layer `layer`, then attend with
        q ([T, H, D]) over each sequence's full context; returns [T, H, D]."""

    # -- observability --------------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> CacheStats: ...

    def kernel_report(self) -> dict[str, Any]:
        """Chosen kernel per phase, refusals and runtime fallbacks (filled by the kernel dispatcher)."""
        return {}

    def check_invariants(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent (used by tests after every op)."""

    def close(self) -> None:
        """Release memory and mappings. Idempotent."""


def create_cache(config: EngineConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    """Build the backend named by `config.backend` (imports lazily: each backend lives in its package)."""
    if config.backend == "paged":
        from kvlab.paged.backend import PagedKVCache as cls
    elif config.backend == "vmm":
        from kvlab.vmm.backend import VMMKVCache as cls
    elif config.backend == "reserve":
        from kvlab.common.reserve_cache import ReserveKVCache as cls
    else:  # config validation makes this unreachable for EngineConfig instances
        from kvlab.common.errors import ConfigError
        raise ConfigError(f"unknown backend {config.backend!r}; choose one of: paged, vmm, reserve")
    return cls(config, shape, accounting_only=accounting_only)
