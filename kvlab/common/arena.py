"""First-fit allocation of token extents in one flat arena (the reserve baseline's regions).

Free space is a sorted list of extents; freeing merges an extent with its free neighbours, so what remains
fragmented is real external fragmentation.
"""
from __future__ import annotations

import bisect


class Arena:
    """First-fit free extents over [0, capacity), kept sorted and merged."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.starts: list[int] = [0] if capacity else []
        self.lengths: list[int] = [capacity] if capacity else []
        self.free_total = capacity

    def find(self, size: int) -> int | None:
        for i, length in enumerate(self.lengths):
            if length >= size:
                return i
        return None

    def take(self, size: int) -> int | None:
        i = self.find(size)
        if i is None:
            return None
        start = self.starts[i]
        if self.lengths[i] == size:
            del self.starts[i], self.lengths[i]
        else:
            self.starts[i] += size
            self.lengths[i] -= size
        self.free_total -= size
        return start

    def give(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        merge_prev = i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start
        merge_next = i < len(self.starts) and start + size == self.starts[i]
        if merge_prev and merge_next:
            self.lengths[i - 1] += size + self.lengths[i]
            del self.starts[i], self.lengths[i]
        elif merge_prev:
            self.lengths[i - 1] += size
        elif merge_next:
            self.starts[i] = start
            self.lengths[i] += size
        else:
            self.starts.insert(i, start)
            self.lengths.insert(i, size)
        self.free_total += size

    @property
    def largest(self) -> int:
        return max(self.lengths, default=0)

    def check(self) -> None:
        end = -1
        for start, length in zip(self.starts, self.lengths):
            assert length > 0 and start > end, "free extents overlap, touch or are empty"
            end = start + length
        assert end <= self.capacity
        assert sum(self.lengths) == self.free_total
