"""Which page groups are in the pool and how many slots map each (forks share groups copy-on-write).

Group g is pool page t*G + g of tensor t, so groups with consecutive ids are consecutive pool pages in every
tensor: taking runs of consecutive groups lets neighbouring mappings merge (host VMAs).
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.vmm.slots import Slot


class PagePool:
    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.free = bytearray(b"\x01") * num_groups   # 1 = group in the pool, unmapped
        self.num_free = num_groups
        self.refs = array("i", [0]) * num_groups      # slots mapping each group
        self.num_shared = 0                           # groups more than one slot maps (0: no copy-on-write)

    def take(self, count: int, prefer: int | None) -> list[int]:
        """Prefer the groups right after `prefer`, then the first run of `count` free groups, then any."""
        taken: list[int] = []

        def take(g: int) -> None:
            self.free[g] = 0
            taken.append(g)
        g = prefer if prefer is not None else self.num_groups
        while len(taken) < count and g < self.num_groups and self.free[g]:
            take(g)
            g += 1
        rest = count - len(taken)
        start = self.free.find(b"\x01" * rest) if rest else -1
        for g in range(start, start + rest) if start >= 0 else ():
            take(g)
        while len(taken) < count:
            take(self.free.find(b"\x01"))
        self.num_free -= count
        return taken

    def own(self, groups: Iterable[int]) -> None:
        """Groups just taken are now mapped by one slot."""
        for g in groups:
            self.refs[g] = 1

    def share(self, groups: Iterable[int]) -> None:
        refs = self.refs
        for g in groups:
            refs[g] += 1
            self.num_shared += refs[g] == 2

    def unshare(self, g: int) -> None:
        """A slot stops mapping a shared group; the other slots still map it."""
        self.refs[g] -= 1
        self.num_shared -= self.refs[g] == 1

    def is_shared(self, g: int) -> bool:
        return self.refs[g] > 1

    def put_back(self, groups: Iterable[int]) -> None:
        """One slot fewer maps each group; a group no slot maps returns to the pool."""
        refs = self.refs
        for g in groups:
            refs[g] -= 1
            if refs[g] == 0:
                self.free[g] = 1
                self.num_free += 1
            elif refs[g] == 1:
                self.num_shared -= 1

    def return_untaken(self, groups: Iterable[int]) -> None:
        """After a failed mapping: groups taken but never owned go back to the pool."""
        for g in groups:
            if self.refs[g] == 0 and not self.free[g]:
                self.free[g] = 1
                self.num_free += 1

    def check(self, slots: list[Slot]) -> None:
        refs = [0] * self.num_groups
        for slot in slots:
            assert len(set(slot.groups)) == len(slot.groups), f"slot {slot.index} maps a group twice"
            for g in slot.groups:
                refs[g] += 1
        assert list(self.refs) == refs, "page refcounts differ from the slots mapping them"
        for g in range(self.num_groups):
            assert bool(self.free[g]) == (refs[g] == 0), f"group {g}: free flag and mappings disagree"
        assert self.num_free == sum(self.free), "free-page count drifted"
        assert self.num_shared == sum(1 for r in refs if r > 1), "shared-page count drifted"
