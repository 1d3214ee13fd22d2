"""The driver side of the vmm pages room (vmm/pages.py): where page j of slot s sits in every tensor
(s * row_bytes + j * page_size), the batch (`Moves`) that carries out a booked move (the reclaimed tails' unmaps,
then a slot's new runs, one mirrored call per run of consecutive groups), and the torn pages: (slot, page)s a call
left maybe not mapped alike in every tensor because it failed and so did its undo. A torn page is cleared, not
unmapped, when it goes; until then check_invariants reports it and the cache must be closed.

With background mapping a growth puts the unmaps of the tails it reclaimed off (`put_off`): the page's memory is
mapped at its new place at once and stays mapped at the old one, which no slot lists (no kernel reads it), until
the mapper's next job runs the unmaps during the forward pass. CUDA and the host both map one physical page at two
places. Anything that maps in a row runs that row's put-off unmaps first (`flush`); one that fails stays put off
and its error reaches the caller at the next fence, as any mapper error."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.vmm.drivers.types import Moves

if TYPE_CHECKING:
    from kvlab.vmm.drivers.base import VirtualMemory
    from kvlab.vmm.drivers.types import Mirror
    from kvlab.vmm.geometry import Geometry
    from kvlab.vmm.reclaim import Reclaimed
    from kvlab.vmm.slots import Slot

Spot = tuple[int, int, int]   # an unmap's slot, first page and page count


class PageCalls:
    def __init__(self, geo: Geometry, driver: VirtualMemory, mirror: Mirror, putting_off: bool) -> None:
        self.driver, self.mirror = driver, mirror
        self.row_bytes, self.page_size = geo.row_bytes, geo.page_size
        self.torn: set[tuple[int, int]] = set()   # (slot, page)
        self.put_off: dict[int, list[Spot]] = {}  # slot -> unmaps a growth put off (pages its row no longer lists)
        self.putting_off = putting_off            # growths put their reclaimed tails' unmaps off (the mapper runs them)

    def at(self, slot: int, page: int) -> int:
        """Where page `page` of slot `slot` sits inside each tensor."""
        return slot * self.row_bytes + page * self.page_size

    def moves(self, reclaimed: list[Reclaimed], slot: Slot, first: int, groups: list[int], hold: int = 0) -> Moves:
        """The batch of booked moves: the reclaimed tails' unmaps (torn ones cleared), then `groups` mapped at
        pages `first`.. of `slot` (one call per run), after holding `hold` pool pages."""
        at = self.at
        return Moves([(at(s.index, f), len(g)) for s, f, g in reclaimed],
                     [(at(slot.index, first + start), groups[start], n) for start, n in group_runs(groups)],
                     hold, self.clear_of(spots(reclaimed)))

    def clear_of(self, unmaps: list[Spot]) -> set[int]:
        """The unmaps (by index) that touch a torn page: they clear instead."""
        return {i for i, spot in enumerate(unmaps) if self.any_torn(*spot)} if self.torn else set()

    def put_off_tails(self, unmaps: list[Spot]) -> None:
        """Leave these unmaps to the mapper's next job (`flush_all`)."""
        for spot in unmaps:
            self.put_off.setdefault(spot[0], []).append(spot)

    def flush(self, slot: int) -> None:
        """Run the unmaps put off in the slot's row (before anything maps there again); those not done stay put off."""
        spots = self.put_off.pop(slot, None)
        if spots is None:
            return
        moves = Moves([(self.at(*spot[:2]), spot[2]) for spot in spots], clear=self.clear_of(spots))
        try:
            self.apply(moves, spots)
        finally:
            if moves.unmapped < len(spots):
                self.put_off[slot] = spots[moves.unmapped:]

    def flush_all(self) -> None:
        for slot in list(self.put_off):
            self.flush(slot)

    def apply(self, moves: Moves, unmaps: list[Spot], slot: int = 0, first: int = 0) -> None:
        """`driver.apply` with the torn pages kept up to date (`unmaps`: where the unmaps are; the maps start at
        page `first` of `slot`)."""
        try:
            self.driver.apply(self.mirror, moves)
        except BaseException:
            self.mark_torn(moves, unmaps, slot, first)
            raise
        if moves.clear:
            self.cleared(moves, unmaps)

    def unmap(self, slot: int, first: int, count: int) -> None:
        """Unmap pages [first, first + count) of the slot in every tensor, all or nothing (torn ones are cleared)."""
        unmaps = [(slot, first, count)]
        self.apply(Moves([(self.at(slot, first), count)], clear=self.clear_of(unmaps)), unmaps)

    def any_torn(self, slot: int, first: int, count: int) -> bool:
        return bool(self.torn) and any((slot, j) in self.torn for j in range(first, first + count))

    def first_torn(self, slot: int) -> int | None:
        return min((j for s, j in self.torn if s == slot), default=None)

    def mark_torn(self, moves: Moves, unmaps: list[Spot], slot: int, first: int) -> None:
        """After a failed batch: the pages of the call that left its places apart, if one did."""
        if moves.torn is None:
            return
        kind, i = moves.torn
        if kind == "unmap":
            self.torn_run(*unmaps[i])
        else:
            offset, _, count = moves.maps[i]
            self.torn_run(slot, first + (offset - moves.maps[0][0]) // self.page_size, count)

    def torn_run(self, slot: int, first: int, count: int) -> None:
        self.torn.update((slot, j) for j in range(first, first + count))

    def cleared(self, moves: Moves, unmaps: list[Spot]) -> None:
        """Torn pages the batch cleared are torn no more."""
        for i in moves.clear:
            slot, first, count = unmaps[i]
            self.torn.difference_update((slot, j) for j in range(first, first + count))


def spots(reclaimed: list[Reclaimed]) -> list[Spot]:
    return [(slot.index, first, len(groups)) for slot, first, groups in reclaimed]


def mapped_groups(moves: Moves) -> int:
    """Groups in the maps of the batch that took effect."""
    return sum(count for _, _, count in moves.maps[:moves.mapped])


def group_runs(groups: list[int]) -> list[tuple[int, int]]:
    """(index, length) runs of consecutive group ids (each run is one mirrored call)."""
    out: list[tuple[int, int]] = []
    for i, g in enumerate(groups):
        if out and groups[out[-1][0]] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
