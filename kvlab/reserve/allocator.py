"""The reserve baseline's allocator: first-fit regions in one flat token arena, no sharing.

Each sequence gets a region of `max_model_len` tokens (reserve_mode "max") or exactly its final length
(`prompt + max_tokens`, reserve_mode "oracle") at admission; freeing merges free neighbours, so differently
sized oracle regions leave real external fragmentation. Fork copies the parent's tokens into a new region (the
baseline's point); swap saves a region to host memory and restores it into whatever region is free then. Units
are tokens. Bookkeeping only: the copies are orders (common/kv/types.py; addresses are start tokens) that the
cache hands to the storage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlab.common.errors import OutOfKVCache
from kvlab.common.kv.seam import Allocator, timed, timed_allocate
from kvlab.common.kv.types import CacheStats, CopyKV, DropSavedKV, RestoreKV, SaveKV
from kvlab.reserve.regions import Regions

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.types import KVShape
    from kvlab.common.sequence import Sequence


class ReserveAllocator(Allocator):
    """The seam's methods over a region book (regions.py)."""

    name = "reserve"
    unit_name = "token"
    tokens_per_unit = 1

    def __init__(self, config: EngineConfig, shape: KVShape) -> None:
        self.mode = config.options_of("reserve").reserve_mode
        self.max_len = config.max_model_len
        self.bytes_per_token = shape.bytes_per_token
        budget = config.kv_cache_bytes // self.bytes_per_token
        self.row_stride = self.max_len if self.mode == "max" else 1
        self.capacity = (budget // self.max_len) * self.max_len if self.mode == "max" else budget
        self.regions = Regions(self.capacity)
        self.swapped: dict[int, int] = {}                  # seq_id -> tokens saved (the storage holds the copy)
        self.swapped_out_bytes = self.swapped_in_bytes = self.fork_copy_tokens = 0
        self.allocator_seconds = 0.0

    def _region_size(self, seq: Sequence, num_tokens: int) -> int:
        return self.max_len if self.mode == "max" else max(seq.final_len, num_tokens)

    # -- capacity -------------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.capacity

    def num_free_units(self) -> int:
        return self.regions.arena.free_total

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        span = self.regions.spans.get(seq.seq_id)
        if span is not None:
            return max(0, num_tokens - span[1])        # > 0 means it can never grow there
        return self._region_size(seq, num_tokens)

    def max_tokens_per_seq(self) -> int:
        if self.mode == "max":
            return self.max_len if self.capacity >= self.max_len else 0
        return self.capacity

    # -- lifecycle ------------------------------------------------------------------------------------------
    @timed_allocate
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        regions = self.regions
        span = regions.spans.get(seq.seq_id)
        if span is None:
            size = self._region_size(seq, num_tokens)
            if not regions.fits(size, reserve_units):
                return None
            regions.claim(seq, size)
        elif num_tokens > span[1]:
            return None                                  # a region never grows
        if num_tokens > regions.held[seq.seq_id]:
            regions.hold(seq.seq_id, num_tokens)
        return 0

    @timed
    def hold_in_place(self, seqs: list[Sequence], targets: list[int], i: int) -> int:
        """allocate's path for sequences already in their regions, as one loop."""
        return self.regions.hold_each(seqs, targets, i)

    @timed
    def free(self, seq: Sequence) -> None:
        if seq.seq_id in self.regions.spans:
            self.regions.release(seq.seq_id)
        if self.swapped.pop(seq.seq_id, None) is not None:
            self.emit(DropSavedKV(seq.seq_id))

    @timed
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """No sharing in the baseline: the child gets its own region and a copy of the parent's tokens."""
        regions = self.regions
        n = regions.held[parent.seq_id]
        size = self._region_size(child, n)
        if not regions.fits(size, 0):
            raise OutOfKVCache(f"reserve cache: no contiguous free region of {size} tokens for fork of "
                               f"sequence {child.seq_id} (free {regions.arena.free_total}, largest extent "
                               f"{regions.arena.largest})")
        start = regions.claim(child, size)
        regions.hold(child.seq_id, n)
        self.emit(CopyKV(regions.spans[parent.seq_id][0], start, n))
        self.fork_copy_tokens += n

    @timed
    def swap_out(self, seq: Sequence) -> None:
        start, _ = self.regions.spans[seq.seq_id]
        n = self.regions.held[seq.seq_id]
        self.emit(SaveKV(seq.seq_id, start, n))
        self.regions.release(seq.seq_id)
        self.swapped[seq.seq_id] = n
        self.swapped_out_bytes += n * self.bytes_per_token

    @timed
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        n = self.swapped[seq.seq_id]
        size = self._region_size(seq, n)
        if not self.regions.fits(size, reserve_units):
            return False                                 # the host copy stays
        start = self.regions.claim(seq, size)
        del self.swapped[seq.seq_id]
        self.regions.hold(seq.seq_id, n)
        self.emit(RestoreKV(seq.seq_id, start, n))
        self.swapped_in_bytes += n * self.bytes_per_token
        return True

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.regions.spans

    # -- observability --------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """The arena's own bytes; a real storage adds its padding rows (ReserveStorage.add_to_stats)."""
        r, arena = self.regions, self.regions.arena
        free, backed = arena.free_total, self.capacity * self.bytes_per_token
        return CacheStats(
            backend=self.name, unit_name=self.unit_name, tokens_per_unit=1, total_units=self.capacity,
            used_units=self.capacity - free, free_units=free, live_tokens=r.live,
            allocated_token_slots=r.allocated, reserved_bytes=backed, mapped_bytes=backed,
            swapped_out_bytes=self.swapped_out_bytes, swapped_in_bytes=self.swapped_in_bytes,
            allocator_seconds=self.allocator_seconds,
            extra={
                "reserve_mode": self.mode,
                "reserved_waste_tokens": r.will_use - r.live,
                "never_used_tokens": r.allocated - r.will_use,
                "num_regions": len(r.spans),
                "free_extents": len(arena.starts),
                "largest_free_extent": arena.largest,
                "external_fragmentation": 1 - arena.largest / free if free else 0.0,
                "fork_copy_tokens": self.fork_copy_tokens,
                "swapped_sequences": len(self.swapped),
                "padding_tokens": 0,
            })

    def snapshot(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "mode": self.mode, "max_len": self.max_len,
                "regions": dict(self.regions.spans), "held": dict(self.regions.held), "swapped": set(self.swapped),
                "free_units": self.regions.arena.free_total}

    def check_invariants(self) -> None:
        self.regions.check(self.capacity, self.row_stride)
