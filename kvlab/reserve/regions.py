"""The reserve baseline's region book: which arena region each resident sequence holds, how many of its tokens
are stored, and the token totals the stats report (live, allocated, will ever be used)."""
from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

from kvlab.common.arena import Arena

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence


class Regions:
    def __init__(self, capacity: int) -> None:
        self.arena = Arena(capacity)
        self.spans: dict[int, tuple[int, int]] = {}     # seq_id -> (start token, size)
        self.held: dict[int, int] = {}                  # seq_id -> tokens stored
        self.final: dict[int, int] = {}                 # seq_id -> min(size, final_len)
        self.live = self.allocated = self.will_use = 0

    def fits(self, size: int, reserve_units: int) -> bool:
        return size + reserve_units <= self.arena.free_total and self.arena.find(size) is not None

    def claim(self, seq: Sequence, size: int) -> int:
        start = self.arena.take(size)
        self.spans[seq.seq_id] = (start, size)
        self.held[seq.seq_id] = 0
        self.final[seq.seq_id] = min(size, seq.final_len)
        self.allocated += size
        self.will_use += self.final[seq.seq_id]
        return start

    def release(self, seq_id: int) -> None:
        start, size = self.spans.pop(seq_id)
        self.arena.give(start, size)
        self.live -= self.held.pop(seq_id)
        self.will_use -= self.final.pop(seq_id)
        self.allocated -= size

    def hold(self, seq_id: int, num_tokens: int) -> None:
        self.live += num_tokens - self.held[seq_id]
        self.held[seq_id] = num_tokens

    def hold_each(self, seqs: list[Sequence], targets: list[int], i: int) -> int:
        """`hold` for seqs[i:] in turn while each target fits the region it has; returns the index of the first
        that has none or asks past its end. The scheduler's per-step loop, so `hold` is inlined."""
        spans, held = self.spans, self.held
        for j in range(i, len(seqs)):
            seq_id, tokens = seqs[j].seq_id, targets[j]
            span = spans.get(seq_id)
            if span is None or tokens > span[1]:
                return j
            if tokens > held[seq_id]:
                self.live += tokens - held[seq_id]
                held[seq_id] = tokens
        return len(seqs)

    def check(self, capacity: int, alignment: int) -> None:
        """Regions lie apart, outside free space, inside the capacity and start at multiples of `alignment`;
        every token is either free or in a region; the totals match."""
        self.arena.check()
        spans = sorted(self.spans.values())
        for (a, sa), (b, _) in itertools.pairwise(spans):
            assert a + sa <= b, "regions overlap"
        for start, size in spans:
            i = bisect.bisect_right(self.arena.starts, start) - 1
            below = i < 0 or self.arena.starts[i] + self.arena.lengths[i] <= start
            assert below, "a region overlaps free space"
            assert start + size <= capacity and start % alignment == 0
        assert self.arena.free_total + sum(s for _, s in spans) == capacity, "tokens leaked"
        assert self.live == sum(self.held.values())
        assert self.allocated == sum(s for _, s in spans)
        assert all(self.held[sid] <= self.spans[sid][1] for sid in self.spans)
