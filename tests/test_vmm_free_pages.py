"""Which free page groups a move takes (vmm/free_pages.py): each run of consecutive groups is one map call per
tensor, so a take prefers the slot's next group, then one run that fits, then the longest runs."""
from __future__ import annotations

import pytest

from kvlab.vmm.free_pages import FreePages


def pages_with_free(pattern: str) -> FreePages:
    """'1' free, '0' taken, group i at position i."""
    free = FreePages(len(pattern))
    for g, flag in enumerate(pattern):
        if flag == "0":
            free.free[g] = 0
            free.num_free -= 1
    return free


@pytest.mark.parametrize(("pattern", "count", "prefer", "taken"), [
    ("1011011101", 4, None, [5, 6, 7, 2]),      # no run of 4: the longest (5-7), then the next longest (2-3)
    ("1011011101", 3, None, [5, 6, 7]),         # the first run that fits
    ("1011011101", 2, None, [2, 3]),
    ("1011011101", 3, 2, [2, 3, 0]),            # from `prefer` (after the slot's last group), then a run of the rest
    ("1010101010", 3, None, [0, 2, 4]),         # only singles: lowest first
])
def test_a_take_uses_the_fewest_runs_it_can(pattern, count, prefer, taken):
    free = pages_with_free(pattern)
    assert free.take(count, prefer) == taken
    assert free.num_free == pattern.count("1") - count
    assert [g for g in range(len(pattern)) if not free.free[g]] == sorted(
        [g for g, f in enumerate(pattern) if f == "0"] + taken)
