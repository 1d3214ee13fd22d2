"""The seam between the engine and a KV-cache backend, split by caller.

- `Allocator`, the scheduler's side: capacity and lifecycle. `allocate` checks and takes in one call and
  answers None ("no room", nothing changed) instead of raising.
- `Storage`, the runner's and model's side: `prepare` builds a step's metadata, `attention` writes the step's
  K/V and runs the kernel the dispatcher picked. The simulator gets a `NullStorage`: the same allocator
  bookkeeping with no memory behind it, instead of accounting branches inside each backend.
- `KVCache` puts the two together for the engine and owns what every backend shares: `close`,
  `kernel_report`, `stats`. It connects the one way between them: the allocator's data-movement orders go to
  the storage's `move` (common/kv/types.py); neither holds the other's reference for that. `timed` is the one
  allocator timer.
Neither side ever asks which backend it talks to; `create_cache` reaches the backend through the configuration's
registered spec (common/kv/registry.py), so this module imports neither the registry nor the configuration.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.common.kv.types import CacheStats, CopyKV, DropSavedKV, KVMove, KVShape, MoveSink, RestoreKV, SaveKV, discard

if TYPE_CHECKING:
    import torch

    from kvlab.common.attention.metadata import AttentionMetadata, BatchItem
    from kvlab.common.sequence import Sequence


class CacheConfig(Protocol):
    """What building a cache reads from the engine configuration; EngineConfig (common/config.py) is the one
    implementation. Named here as a protocol because config.py imports the registry, which imports this module."""
    backend: str
    kv_cache_bytes: int
    kv_cache_dtype: str
    kv_cache_scale: float
    max_model_len: int
    max_num_seqs: int
    device: str
    kernel: str
    enable_prefix_caching: bool
    check_invariants: bool

    @property
    def spec(self) -> CacheBuilder:
        """The registered spec of `backend`."""

    def options_of(self, backend: str) -> Any:
        """The options dataclass of a registered backend."""


class CacheBuilder(Protocol):
    """A backend's way to build its cache (BackendSpec, common/kv/registry.py)."""

    def build(self, config: CacheConfig, shape: KVShape, accounting_only: bool) -> KVCache: ...


class Allocator(ABC):
    """Capacity and lifecycle, counted in units of `tokens_per_unit` tokens. The scheduler's only view."""

    name: str = "abstract"
    unit_name: str = "unit"
    tokens_per_unit: int = 1
    allocator_seconds: float = 0.0     # accumulated by @timed
    # Where the data movements this allocator decides go (common/kv/types.py); the cache connects it to its storage.
    emit: MoveSink = staticmethod(discard)

    @abstractmethod
    def num_total_units(self) -> int: ...

    @abstractmethod
    def num_free_units(self) -> int: ...

    def max_tokens_per_seq(self) -> int:
        """The longest sequence this cache could ever hold alone (for "can never fit" errors)."""
        return self.num_total_units() * self.tokens_per_unit

    @abstractmethod
    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra units `seq` needs to hold `num_tokens` tokens (0 if it already can); asks, changes nothing."""

    def begin_step(self) -> None:
        """A scheduler step starts (a pooled vmm allocator may wait for other engines' pages once per step)."""

    def shortage_is_transient(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` refused alone at `num_tokens` could fit later with nothing of its own to free (memory
        shared with other engines comes back); False: alone in this cache it never fits."""
        return False

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        """Make `seq` hold `num_tokens` tokens if that leaves `reserve_units` free (the watermark). Returns
        None when there is no room (nothing changed), else how many leading tokens a prefix-cache hit
        already holds (only on a sequence's first allocation; 0 without prefix caching)."""

    def allocate_each(self, seqs: list[Sequence], targets: list[int]) -> int:
        """`allocate(seq, target)` for each pair in turn, stopping at the first that finds no room; returns how many
        succeeded. The scheduler's per-step call for its running sequences: one call a step rather than one a
        sequence, so that the common case (`hold_in_place`) runs as one loop under one timer."""
        done = 0
        while done < len(seqs):
            done = self.hold_in_place(seqs, targets, done)
            if done == len(seqs) or self.allocate(seqs[done], targets[done]) is None:
                break
            done += 1
        return done

    def hold_in_place(self, seqs: list[Sequence], targets: list[int], i: int) -> int:
        """From seqs[i] on, let each sequence hold its target where that moves nothing but counts (a decode
        token in a unit it already holds); returns the index of the first that needs `allocate`. Backends
        override it (timed); this default leaves every sequence to `allocate`."""
        return i

    @abstractmethod
    def free(self, seq: Sequence) -> None: ...

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every unit of the parent; a shared partial unit is copied on the child's write."""

    @abstractmethod
    def swap_out(self, seq: Sequence) -> None:
        """Copy seq's KV to host memory and release its units."""

    @abstractmethod
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        """Take units again and restore seq's KV from host memory; False (nothing changed) if there is no
        room with `reserve_units` left free."""

    @abstractmethod
    def holds(self, seq: Sequence) -> bool:
        """Whether KV for `seq` is resident: True from its first `allocate` (or `fork`, or `swap_in`) until
        `free` or `swap_out`. A swapped-out sequence is not held (`free` drops its host copy)."""

    @abstractmethod
    def stats(self) -> CacheStats: ...

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """Public, plain-data view of the bookkeeping for invariant checks: what each sequence holds, unit
        reference counts, and whatever else the backend's probe compares."""

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it after every operation)."""

    def close(self) -> None:
        """Release what the allocator itself holds (mappings, worker threads). Idempotent."""


class Storage(ABC):
    """Where K/V live and how attention reads them: the runner's and the model's only view. Real storages
    build their kernel dispatcher once, here."""

    dispatcher: Any = None

    @abstractmethod
    def prepare(self, items: list[BatchItem]) -> AttentionMetadata:
        """This step's metadata. Every item's sequence must already hold its context_len tokens."""

    @abstractmethod
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write k, v ([T, H_kv, D]) for this step's tokens into layer `layer`, then attend with
        q ([T, H, D]) over each sequence's context; returns [T, H, D]."""

    def build_dispatcher(self, shape: KVShape, layout: str, kernel: str, **spec: Any) -> None:
        """Pick this storage's kernels for its layout and shape (refusals and fallbacks are recorded)."""
        import torch

        from kvlab.common.attention.dispatch import AttentionSpec, make_dispatcher
        device = torch.device(shape.device)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        self.dispatcher = make_dispatcher(AttentionSpec(
            layout=layout, device=device.type, dtype=shape.dtype, kv_cache_dtype=shape.kv_cache_dtype,
            sliding_window=shape.sliding_window, head_dim=shape.head_dim,
            num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads, compute_capability=capability,
            **spec), kernel)

    @abstractmethod
    def move(self, order: KVMove) -> None:
        """Carry out a data movement the allocator decided (common/kv/types.py), before returning."""

    def add_to_stats(self, stats: CacheStats) -> None:
        """Add what the storage holds beyond the allocator's units (the reserve arena's padding rows)."""

    def kernel_report(self) -> dict[str, Any]:
        """Chosen kernel per phase, refusals and runtime fallbacks."""
        return self.dispatcher.report() if self.dispatcher is not None else {}

    def close(self) -> None:
        """Drop the device memory. Idempotent."""


class DataStorage(Storage):
    """A storage with memory behind it: it carries out the allocator's orders with three operations on its own
    addresses (`copy`, `save` to the host, `restore`), and keeps each swapped-out sequence's host copy, keyed
    by seq_id, until the sequence is swapped in or freed. Orders are synchronous: done when `move` returns."""

    def __init__(self) -> None:
        self.saved: dict[int, Any] = {}

    @abstractmethod
    def copy(self, src: Any, dst: Any, num_tokens: int) -> None: ...

    @abstractmethod
    def save(self, where: Any, num_tokens: int) -> Any:
        """A host copy of the tokens held at `where`."""

    @abstractmethod
    def restore(self, where: Any, num_tokens: int, host: Any) -> None:
        """Write what `save` returned at `where`."""

    def move(self, order: KVMove) -> None:
        match order:
            case CopyKV(src, dst, num_tokens):
                self.copy(src, dst, num_tokens)
            case SaveKV(seq_id, where, num_tokens):
                self.saved[seq_id] = self.save(where, num_tokens)
            case RestoreKV(seq_id, where, num_tokens):
                self.restore(where, num_tokens, self.saved.pop(seq_id))
            case DropSavedKV(seq_id):
                del self.saved[seq_id]

    def close(self) -> None:
        self.saved.clear()


class NullStorage(Storage):
    """No memory at all: the simulator's storage. The allocator's bookkeeping runs unchanged."""

    def prepare(self, items: list[BatchItem]) -> AttentionMetadata:
        raise RuntimeError("an accounting-only cache has no storage to run attention on")

    def attention(self, layer, q, k, v, meta, scale):
        raise RuntimeError("an accounting-only cache has no storage to run attention on")

    def move(self, order: KVMove) -> None:
        """No memory, nothing to move: the bookkeeping alone is simulated."""


@dataclass(slots=True)
class KVCache:
    """One backend instance as the engine sees it: the allocator for the scheduler, the storage for the
    runner and model, and the shared close/report/stats."""
    allocator: Allocator
    storage: Storage
    shape: KVShape
    closed: bool = False

    def __post_init__(self) -> None:
        self.allocator.emit = self.storage.move     # the one connection: allocator orders -> storage

    @property
    def name(self) -> str:
        return self.allocator.name

    @property
    def accounting_only(self) -> bool:
        return isinstance(self.storage, NullStorage)

    def stats(self) -> CacheStats:
        stats = self.allocator.stats()
        self.storage.add_to_stats(stats)
        stats.extra["kv_cache_dtype"] = self.shape.kv_cache_dtype
        return stats

    def kernel_report(self) -> dict[str, Any]:
        return self.storage.kernel_report()

    def check_invariants(self) -> None:
        self.allocator.check_invariants()

    def close(self) -> None:
        """Storage first (views over the allocator's memory), then the allocator. Idempotent."""
        if not self.closed:
            self.closed = True
            try:
                self.storage.close()
            finally:
                self.allocator.close()


def timed(method: Callable) -> Callable:
    """Count the wall time of an allocator method in `self.allocator_seconds` (the one allocator timer)."""
    clock = time.perf_counter

    @functools.wraps(method)
    def wrapper(self: Allocator, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.allocator_seconds += clock() - start
    return wrapper


def timed_allocate(method: Callable) -> Callable:
    """`timed` for `allocate(seq, num_tokens, reserve_units=0)`, called for every running sequence every step: the
    fixed signature avoids packing the arguments, which is most of a generic wrapper's cost."""
    clock = time.perf_counter

    @functools.wraps(method)
    def allocate(self: Allocator, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        start = clock()
        try:
            return method(self, seq, num_tokens, reserve_units)
        finally:
            self.allocator_seconds += clock() - start
    return allocate


def create_cache(config: CacheConfig, shape: KVShape, accounting_only: bool = False) -> KVCache:
    """Build the backend named by `config.backend`, through its registered spec (no backend import here)."""
    if config.kv_cache_dtype != shape.kv_cache_dtype:   # the config's KV dtype decides what is stored
        shape = dataclasses.replace(shape, kv_cache_dtype=config.kv_cache_dtype)
    from kvlab.common.machine import check_physical_budget
    if not accounting_only:
        check_physical_budget(config.device, config.kv_cache_bytes)
    return config.spec.build(config, shape, accounting_only)
