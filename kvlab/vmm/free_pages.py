"""The page groups of the vmm cache: which are free and how many slots map each (`FreePages`), and the
counters the moves of pages keep (`PageCounters`).

Group g is pool page t*G + g of tensor t, so groups with consecutive ids are consecutive pool pages in every
tensor: taking runs of consecutive groups lets neighbouring mappings merge (host VMAs).
"""
from __future__ import annotations

import re
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.vmm.prefix import PagePrefixCache
    from kvlab.vmm.slots import Slot

FREE_RUN = re.compile(b"\x01+")   # a run of free groups in FreePages.free


@dataclass(slots=True)
class PageCounters:
    cow_copies: int = 0            # shared pages copied for a writer
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    reclaimed_units: int = 0       # pages unmapped to make room (stale slots, pages mapped ahead)
    lookahead_pages: int = 0       # pages the background mapper mapped ahead of need
    lookahead_skipped: int = 0     # background jobs that found no free group
    window_dropped_pages: int = 0  # page groups unmapped below a sliding window (back to the free list)
    evicted_for_pool: int = 0      # idle cached groups evicted to give their pages to other engines on the pool
    # OS map and unmap calls (one per tensor and run) made by first allocations and by growths, on the step (the
    # background mapper counts its own jobs')
    admission_calls: int = 0
    growth_calls: int = 0


class FreePages:
    """Free flags and per-group slot counts (forks and prefix hits share groups copy-on-write). With a prefix
    cache, a cached group no slot maps is neither free nor mapped: it is idle in the cache until evicted."""

    def __init__(self, num_groups: int, cache: PagePrefixCache | None = None) -> None:
        self.num_groups, self.cache = num_groups, cache
        self.free = bytearray(b"\x01") * num_groups   # 1 = group free, unmapped
        self.num_free = num_groups
        self.refs = array("i", [0]) * num_groups      # slots mapping each group
        self.num_shared = 0                           # groups more than one slot maps (0: no copy-on-write)

    def take(self, count: int, prefer: int | None) -> list[int]:
        """Prefer the groups right after `prefer`, then the first run of the rest, then the longest runs: each run
        is one map call per tensor."""
        free, taken = self.free, []
        g = prefer if prefer is not None else self.num_groups
        while len(taken) < count and g < self.num_groups and free[g]:
            free[g] = 0
            taken.append(g)
            g += 1
        rest = count - len(taken)
        if rest:
            start = free.find(b"\x01" * rest)
            runs = [(rest, start)] if start >= 0 else sorted(
                ((m.end() - m.start(), m.start()) for m in FREE_RUN.finditer(free)), key=lambda r: (-r[0], r[1]))
            for length, first in runs:
                n = min(length, count - len(taken))
                free[first:first + n] = bytes(n)
                taken.extend(range(first, first + n))
                if len(taken) == count:
                    break
        self.num_free -= count
        return taken

    def own(self, groups: Iterable[int]) -> None:
        """Groups just taken are now mapped by one slot."""
        for g in groups:
            self.refs[g] = 1

    def share(self, groups: Iterable[int]) -> None:
        """One slot more maps each group (a fork child, or a prefix hit: an idle cached group leaves the LRU)."""
        refs = self.refs
        for g in groups:
            if refs[g] == 0:
                self.cache.unpark(g)
            refs[g] += 1
            self.num_shared += refs[g] == 2

    def unshare(self, g: int) -> None:
        """A slot stops mapping a shared group; the other slots still map it."""
        self.refs[g] -= 1
        self.num_shared -= self.refs[g] == 1

    def is_shared(self, g: int) -> bool:
        return self.refs[g] > 1

    def put_back(self, groups: list[int]) -> None:
        """One slot fewer maps each group; a group no slot maps becomes free, or, if cached, idles in the
        cache's LRU (last pages first, so a chain's tail is evicted before its head)."""
        refs, cache = self.refs, self.cache
        for g in reversed(groups):
            refs[g] -= 1
            if refs[g] == 0:
                if cache is not None and cache.is_cached(g):
                    cache.park(g)
                    continue
                self.free[g] = 1
                self.num_free += 1
            elif refs[g] == 1:
                self.num_shared -= 1

    def num_idle(self) -> int:
        """Cached groups no slot maps: free capacity once evicted."""
        return len(self.cache.idle) if self.cache is not None else 0

    def is_cached(self, g: int) -> bool:
        return self.cache is not None and self.cache.is_cached(g)

    def evict(self, count: int) -> int:
        """Return up to `count` idle cached groups to the free list, least recently used first (whole groups)."""
        if self.cache is None:
            return 0
        groups = self.cache.evict(count)
        for g in groups:
            self.free[g] = 1
        self.num_free += len(groups)
        return len(groups)

    def unown(self, groups: list[int]) -> None:
        """Groups booked for one slot that the driver did not map: free again."""
        for g in groups:
            self.refs[g] = 0
        self.return_untaken(groups)

    def retake(self, groups: list[int]) -> None:
        """Reclaimed groups whose slot lists them again after all (their unmap did not happen). A reclaimed group
        is exclusive and never cached (pages no live token needs), so put_back freed it."""
        for g in groups:
            assert self.refs[g] == 0 and self.free[g], f"group {g} was taken while its unmap was pending"
            self.free[g], self.refs[g] = 0, 1
        self.num_free -= len(groups)

    def return_untaken(self, groups: Iterable[int]) -> None:
        """After a failed mapping: groups taken but never owned are free again."""
        for g in groups:
            if self.refs[g] == 0 and not self.free[g] and not self.is_cached(g):
                self.free[g] = 1
                self.num_free += 1

    def check(self, slots: list[Slot]) -> None:
        refs = [0] * self.num_groups
        for slot in slots:
            groups = slot.live_groups()
            assert len(set(groups)) == len(groups), f"slot {slot.index} maps a group twice"
            for g in groups:
                refs[g] += 1
        assert list(self.refs) == refs, "page refcounts differ from the slots mapping them"
        for g in range(self.num_groups):
            assert bool(self.free[g]) == (refs[g] == 0 and not self.is_cached(g)), \
                f"group {g}: free flag and mappings disagree"
        if self.cache is not None:
            self.cache.check(refs)
        assert self.num_free == sum(self.free), "free-page count drifted"
        assert self.num_shared == sum(1 for r in refs if r > 1), "shared-page count drifted"
