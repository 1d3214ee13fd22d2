"""How many OS mappings a reserved range has when neighbouring mappings of consecutive store pages merge (Linux
VMAs): the rule for one edge between VA pages, and what mapping or unmapping a run of pages changes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.vmm.drivers.types import Region


def boundary(a: int | None, b: int | None) -> bool:
    """Whether neighbouring VA pages mapping store pages a and b (None: unmapped) lie in different OS mappings,
    where mappings of consecutive store pages merge (host VMAs)."""
    if a is None or b is None:
        return a is not b
    return b != a + 1


def map_delta(pages: dict[int, int], first: int, count: int, page: int, size: int) -> int:
    """OS mappings added by mapping store pages [page, +count) at the unmapped VA pages [first, +count) of a range
    of `size` pages whose table is `pages`. Only the two outer edges change: the run itself is consecutive."""
    delta = 0
    if first >= 1:
        a = pages.get(first - 1)
        delta += boundary(a, page) - (a is not None)
    end = first + count
    if end < size:
        c = pages.get(end)
        delta += boundary(page + count - 1, c) - (c is not None)
    return delta


def unmap_delta(pages: dict[int, int], first: int, count: int, size: int) -> int:
    """OS mappings added (negative: removed) by unmapping the mapped VA pages [first, +count)."""
    delta = 0
    if first >= 1:
        a = pages.get(first - 1)
        delta += (a is not None) - boundary(a, pages[first])
    end = first + count
    if end < size:
        c = pages.get(end)
        delta += (c is not None) - boundary(pages[end - 1], c)
    for i in range(first + 1, end):
        delta -= pages[i] != pages[i - 1] + 1
    return delta


def count_vmas(pages: dict[int, int], size: int) -> int:
    """OS mappings of a range of `size` pages (PROT_NONE gaps included) when neighbours merge."""
    edges = {e for v in pages for e in (v, v + 1) if 1 <= e < size}
    return 1 + sum(boundary(pages.get(e - 1), pages.get(e)) for e in edges)



def region_map_delta(region: Region, first: int, count: int, page: int, page_size: int, merges: bool) -> int:
    """`map_delta` on a range's own table; without merging every page is its own mapping."""
    if not count:
        return 0
    return map_delta(region.pages, first, count, page, region.nbytes // page_size) if merges else count


def region_unmap_delta(region: Region, first: int, count: int, page_size: int, merges: bool) -> int:
    if not count:
        return 0
    return unmap_delta(region.pages, first, count, region.nbytes // page_size) if merges else -count
