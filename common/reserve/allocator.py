"""The reserve baseline's allocator: first-fit regions in one flat token arena, no sharing.

Each sequence gets a region of `max_model_len` tokens (reserve_mode "max") or exactly its final length
(`prompt + max_tokens`, reserve_mode "oracle") at admission; freeing merges free neighbours, so differently
sized oracle regions leave real external fragmentation. Fork copies the parent's tokens into a new region (the
baseline's point); swap copies a region to host memory and back into whatever region is free then. Units are
tokens. Data moves through the storage's copy/save/restore (no-ops on the null storage).
"""
from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING, Any

from kvlab.common.arena import Arena
from kvlab.common.errors import OutOfKVCache
from kvlab.common.kv.seam import Allocator, timed, timed_allocate
from kvlab.common.kv.types import CacheStats

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.types import KVShape
    from kvlab.common.reserve.storage import ReserveData
    from kvlab.common.sequence import Sequence


class ReserveAllocator(Allocator):
    """Regions in one token arena. 20 methods: the seam's 14 and the region bookkeeping they share."""

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
        self.arena = Arena(self.capacity)
        self.regions: dict[int, tuple[int, int]] = {}      # seq_id -> (start, size)
        self.held: dict[int, int] = {}                     # seq_id -> tokens stored
        self.final: dict[int, int] = {}                    # seq_id -> min(size, final_len)
        self.swap_store: dict[int, tuple[int, Any]] = {}   # seq_id -> (tokens, the storage's host copy)
        self.live = self.allocated = self.will_use = 0
        self.swapped_out_bytes = self.swapped_in_bytes = self.fork_copy_tokens = 0
        self.allocator_seconds = 0.0
        self.data: ReserveData | None = None               # set by build_reserve

    # -- regions --------------------------------------------------------------------------------------------
    def _region_size(self, seq: Sequence, num_tokens: int) -> int:
        return self.max_len if self.mode == "max" else max(seq.final_len, num_tokens)

    def _fits(self, size: int, reserve_units: int) -> bool:
        return size + reserve_units <= self.arena.free_total and self.arena.find(size) is not None

    def _claim(self, seq: Sequence, size: int) -> int:
        start = self.arena.take(size)
        self.regions[seq.seq_id] = (start, size)
        self.held[seq.seq_id] = 0
        self.final[seq.seq_id] = min(size, seq.final_len)
        self.allocated += size
        self.will_use += self.final[seq.seq_id]
        return start

    def _release(self, seq_id: int) -> None:
        start, size = self.regions.pop(seq_id)
        self.arena.give(start, size)
        self.live -= self.held.pop(seq_id)
        self.will_use -= self.final.pop(seq_id)
        self.allocated -= size

    def _set_held(self, seq_id: int, num_tokens: int) -> None:
        self.live += num_tokens - self.held[seq_id]
        self.held[seq_id] = num_tokens

    def region(self, seq_id: int) -> tuple[int, int]:
        """(start token, size) of a resident sequence's region (the storage builds its metadata from it)."""
        return self.regions[seq_id]

    # -- capacity -------------------------------------------------------------------------------------------
    def num_total_units(self) -> int:
        return self.capacity

    def num_free_units(self) -> int:
        return self.arena.free_total

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        region = self.regions.get(seq.seq_id)
        if region is not None:
            return max(0, num_tokens - region[1])      # > 0 means it can never grow there
        return self._region_size(seq, num_tokens)

    def max_tokens_per_seq(self) -> int:
        if self.mode == "max":
            return self.max_len if self.capacity >= self.max_len else 0
        return self.capacity

    # -- lifecycle ------------------------------------------------------------------------------------------
    @timed_allocate
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        region = self.regions.get(seq.seq_id)
        if region is None:
            size = self._region_size(seq, num_tokens)
            if not self._fits(size, reserve_units):
                return None
            self._claim(seq, size)
        elif num_tokens > region[1]:
            return None                                  # a region never grows
        if num_tokens > self.held[seq.seq_id]:
            self._set_held(seq.seq_id, num_tokens)
        return 0

    @timed
    def free(self, seq: Sequence) -> None:
        if seq.seq_id in self.regions:
            self._release(seq.seq_id)
        self.swap_store.pop(seq.seq_id, None)

    @timed
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """No sharing in the baseline: the child gets its own region and a copy of the parent's tokens."""
        n = self.held[parent.seq_id]
        size = self._region_size(child, n)
        if not self._fits(size, 0):
            raise OutOfKVCache(f"reserve cache: no contiguous free region of {size} tokens for fork of "
                               f"sequence {child.seq_id} (free {self.arena.free_total}, largest extent "
                               f"{self.arena.largest})")
        start = self._claim(child, size)
        self._set_held(child.seq_id, n)
        self.data.copy(self.regions[parent.seq_id][0], start, n)
        self.fork_copy_tokens += n

    @timed
    def swap_out(self, seq: Sequence) -> None:
        start, _ = self.regions[seq.seq_id]
        n = self.held[seq.seq_id]
        host = self.data.save(start, n)
        self._release(seq.seq_id)
        self.swap_store[seq.seq_id] = (n, host)
        self.swapped_out_bytes += n * self.bytes_per_token

    @timed
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        n, host = self.swap_store[seq.seq_id]
        size = self._region_size(seq, n)
        if not self._fits(size, reserve_units):
            return False                                 # the host copy stays
        start = self._claim(seq, size)
        del self.swap_store[seq.seq_id]
        self._set_held(seq.seq_id, n)
        self.data.restore(start, n, host)
        self.swapped_in_bytes += n * self.bytes_per_token
        return True

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.regions

    # -- observability --------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        free = self.arena.free_total
        padding = self.data.padding_tokens
        backed = (self.capacity + padding) * self.bytes_per_token
        return CacheStats(
            backend=self.name, unit_name=self.unit_name, tokens_per_unit=1, total_units=self.capacity,
            used_units=self.capacity - free, free_units=free, live_tokens=self.live,
            allocated_token_slots=self.allocated, reserved_bytes=backed, mapped_bytes=backed,
            swapped_out_bytes=self.swapped_out_bytes, swapped_in_bytes=self.swapped_in_bytes,
            allocator_seconds=self.allocator_seconds,
            extra={
                "reserve_mode": self.mode,
                "reserved_waste_tokens": self.will_use - self.live,
                "never_used_tokens": self.allocated - self.will_use,
                "num_regions": len(self.regions),
                "free_extents": len(self.arena.starts),
                "largest_free_extent": self.arena.largest,
                "external_fragmentation": 1 - self.arena.largest / free if free else 0.0,
                "fork_copy_tokens": self.fork_copy_tokens,
                "swapped_sequences": len(self.swap_store),
                "padding_tokens": padding,
            })

    def snapshot(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "mode": self.mode, "max_len": self.max_len,
                "regions": dict(self.regions), "held": dict(self.held), "swapped": set(self.swap_store),
                "free_units": self.arena.free_total}

    def check_invariants(self) -> None:
        self.arena.check()
        spans = sorted(self.regions.values())
        for (a, sa), (b, _) in itertools.pairwise(spans):
            assert a + sa <= b, "regions overlap"
        for start, size in spans:
            i = bisect.bisect_right(self.arena.starts, start) - 1
            below = i < 0 or self.arena.starts[i] + self.arena.lengths[i] <= start
            assert below, "a region overlaps free space"
            assert start + size <= self.capacity
            assert self.mode == "oracle" or start % self.max_len == 0
        assert self.arena.free_total + sum(s for _, s in spans) == self.capacity, "tokens leaked"
        assert self.live == sum(self.held.values())
        assert self.allocated == sum(s for _, s in spans)
        assert all(self.held[sid] <= self.regions[sid][1] for sid in self.regions)
