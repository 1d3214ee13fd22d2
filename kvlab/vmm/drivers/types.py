"""The plain data the virtual-memory drivers share: a reserved range (`Region`), mirrored places (`Mirror`), the
counters (`DriverStats`), the two partial-failure errors, `OSMemory`, the OS calls each driver makes (host, cuda,
accounting), `Moves`, a batch of mirrored calls, and `Books`, what the composed parts (vmm/drivers/mirror.py,
vmm/drivers/teardown.py) need of a driver. A leaf: it imports nothing of vmm."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvlab.common.errors import DriverError


class PartialCall(DriverError):
    """Raised by `OSMemory.map`/`unmap` when a call failed after its first `pages_done` pages took effect (and could
    not be undone); any other exception from them means no page changed."""

    def __init__(self, message: str, pages_done: int) -> None:
        super().__init__(message)
        self.pages_done = pages_done


class TornMirror(DriverError):
    """A mirrored call failed and so did its undo: its places no longer match (the books say what each maps)."""


@dataclass(slots=True)
class Region:
    """A reserved virtual range: `mapped` holds the store page mapped at each mapped VA page index, `segments`
    its OS mappings (host: VMAs incl. PROT_NONE gaps; cuda: mapped pages). Read them through these names: an
    accounting driver may bring them up to date only when they are read (`pending`, vmm/drivers/mirror_books.py)."""
    base: int
    nbytes: int
    pages: dict[int, int] = field(default_factory=dict)
    vmas: int = 1
    live_views: int = 0          # tensor views still alive (weakref.finalize on what each view keeps alive)
    released: bool = False
    orphan_release: Callable[[Region], None] | None = None   # set when its driver died first
    pending: Callable[[], None] | None = None                # brings `pages` and `vmas` up to date

    @property
    def mapped(self) -> dict[int, int]:
        if self.pending is not None:
            self.pending()
        return self.pages

    @property
    def segments(self) -> int:
        if self.pending is not None:
            self.pending()
        return self.vmas


@dataclass(slots=True, eq=False)
class Mirror:
    """Places mapped in lockstep (the vmm cache's 2L tensors): every map or unmap applies at the same offset in
    each place, and place i maps store page `page + i * store_stride` where place 0 maps `page`."""
    places: tuple[tuple[Region, int], ...]   # (range, byte offset of the place in it)
    span: int                                # bytes per place
    store_stride: int
    books: Any = None                        # accounting drivers: a MirrorBooks, the books kept once for all places


@dataclass(slots=True)
class DriverStats:
    reserved_bytes: int = 0
    store_pages: int = 0
    mapped_pages: int = 0        # VA pages currently mapped (a shared store page counts once per mapping)
    num_mappings: int = 0        # host: VMAs of our ranges; cuda: cuMemMap mappings
    map_calls: int = 0           # OS/driver calls made to map
    unmap_calls: int = 0
    map_seconds: float = 0.0
    unmap_seconds: float = 0.0
    pages_mapped: int = 0        # cumulative pages mapped / unmapped (per-page cost = seconds / pages)
    pages_unmapped: int = 0
    discarded_pages: int = 0     # store pages whose memory was given back
    release_retries: int = 0     # unmaps tried again, page by page, after failing while releasing a range
    map_refusals: int = 0        # maps refused for lack of OS mappings (MapBudgetExhausted)
    deferred_releases: int = 0   # ranges close() left to be released when their last tensor view dies
    per_place_fallbacks: int = 0  # accounting driver: mirrors booked place by place after a direct call


@dataclass(slots=True)
class Moves:
    """One change's mirrored calls, carried out in order by `VirtualMemory.apply`: hold `hold` pool pages, unmap the
    `unmaps` (offset, pages; those whose index is in `clear` are cleared instead: torn places), then map the `maps`
    (offset, store page, pages). Afterwards, also after a failure: the first `unmapped` unmaps and the first
    `mapped` maps took effect, and `torn` names the call ("unmap" or "map", index) whose places were left apart."""
    unmaps: list[tuple[int, int]] = field(default_factory=list)
    maps: list[tuple[int, int, int]] = field(default_factory=list)
    hold: int = 0
    clear: set[int] = field(default_factory=set)
    unmapped: int = 0
    mapped: int = 0
    torn: tuple[str, int] | None = None


class OSMemory(Protocol):
    """The calls a driver makes of the OS (or the CUDA driver), each one thing with no books: vmm/drivers/base.py
    checks every request and books what changed. `merges`: whether neighbouring mappings of consecutive store pages
    coalesce into one OS mapping (Linux VMAs do; CUDA mappings do not). `unmaps_runs`: whether one call unmaps a
    run of pages however long (an mmap does; CUDA unmaps page by page)."""
    name: str
    merges: bool
    unmaps_runs: bool

    def granularity(self) -> int:
        """The smallest page size the OS/driver allows; page_size is a multiple of it."""

    def reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` of address space; returns its base."""

    def release(self, region: Region) -> None: ...

    def resize_store(self, old_pages: int, new_pages: int) -> None: ...

    def map(self, addr: int, first_page: int, num_pages: int) -> int:
        """Map store pages [first_page, +num_pages) at addr; returns the number of OS calls made. On failure undo
        what it can: raise `PartialCall` if the first pages stay mapped, any other error if none does."""

    def unmap(self, addr: int, num_pages: int) -> int:
        """Unmap num_pages pages at addr, leaving the range reserved; returns the number of OS calls made. Raise
        `PartialCall` if the first pages were unmapped before the failure, any other error if none was."""

    def discard(self, first_page: int, num_pages: int) -> None: ...

    def view(self, region: Region, offset: int, nbytes: int) -> tuple[Any, Any]:
        """A zero-copy uint8 tensor over [base + offset, +nbytes) and the object whose life tracks the view."""

    def close(self, store_maps: Sequence[int]) -> None:
        """Give the page store back; `store_maps`: the mappings each store page still has."""


class Books(Protocol):
    """What a driver offers its composed parts (package-private: they are part of the driver): checked, booked
    map/unmap, its ranges and counters, booking an unmap the OS did implicitly, and its OS calls."""
    name: str
    page_size: int
    stats: DriverStats
    regions: list[Region]
    closed: bool
    os: OSMemory
    mappings: Any
    store_maps: Sequence[int]

    def map(self, region: Region, offset: int, page: int, num_pages: int = 1) -> None: ...

    def unmap(self, region: Region, offset: int, num_pages: int = 1) -> None: ...

    def _unmap(self, region: Region, offset: int, num_pages: int = 1) -> None: ...

    def live_views(self, region: Region | None = None) -> int: ...

    def _book_unmap(self, region: Region, first: int, num_pages: int, delta: int) -> None: ...


def runs(indices: list[int], pages: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """Sorted indices -> (start, length) runs of consecutive values (that, given `pages`, map consecutive store
    pages)."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i and (pages is None or pages[i] == pages[i - 1] + 1):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
