"""Mirrored mapping (the 2L tensors mapped in lockstep): the accounting driver books a mirror once for all places
(vmm/ledger.py) and must report exactly what booking it place by place reports, and what the kernel shows."""
from __future__ import annotations

import logging
import random

import pytest

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.accounting import AccountingVirtualMemory
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.host import HostVirtualMemory

PAGE = 4096
STATS = ("mapped_pages", "num_mappings", "map_calls", "unmap_calls", "pages_mapped", "pages_unmapped")


class PerPlace(AccountingVirtualMemory):
    """The accounting driver without its ledger: every mirrored call goes place by place (the reference)."""

    def mirror(self, places, span, store_stride):
        return VirtualMemory.mirror(self, places, span, store_stride)


def layout(driver: VirtualMemory, kind: str, places: int, size: int) -> list:
    span = size * PAGE
    if kind == "separate":           # one range per place (the default cache layout)
        return [(driver.reserve(span), 0) for _ in range(places)]
    if kind == "single":             # places side by side in one range (single_range=True)
        whole = driver.reserve(places * span)
        return [(whole, i * span) for i in range(places)]
    whole = driver.reserve((places * (size + 2) + 1) * PAGE)   # "gapped": unmapped pages around every place
    return [(whole, (1 + i * (size + 2)) * PAGE) for i in range(places)]


def books(driver: VirtualMemory, places: list) -> tuple:
    regions = list({id(r): r for r, _ in places}.values())
    return (tuple(getattr(driver.stats, name) for name in STATS), [sorted(r.mapped.items()) for r in regions],
            [r.segments for r in regions], list(driver.store_maps))


@pytest.mark.parametrize("kind", ["separate", "single", "gapped"])
@pytest.mark.parametrize("merges", [True, False])
def test_mirrored_books_match_per_place_books(kind, merges):
    places, size, groups = 3, 5, 6
    rng = random.Random(f"{kind}{merges}")
    drivers = [AccountingVirtualMemory(PAGE, merges=merges), PerPlace(PAGE, merges=merges)]
    mirrors = []
    for d in drivers:
        d.create_store(places * groups)
        spots = layout(d, kind, places, size)
        mirrors.append((d.mirror(spots, size * PAGE, groups), spots))
    assert mirrors[0][0].books is not None and mirrors[1][0].books is None
    rows: dict[int, int] = {}
    joined = 0                                               # steps where neighbouring places could merge
    for step in range(400):
        first = rng.randrange(size)
        if first in rows:                                    # unmap a run of mapped pages
            n = rng.randint(1, next(k for k in range(1, size - first + 1) if first + k not in rows))
            for d, (m, _) in zip(drivers, mirrors):
                d.unmap_mirrored(m, first * PAGE, n)
            for j in range(first, first + n):
                del rows[j]
        else:                                                # map a run of free groups (often after a neighbour)
            room = 1
            while first + room < size and first + room not in rows:
                room += 1
            n = rng.randint(1, room)
            used = set(rows.values())
            starts = [g for g in range(groups - n + 1) if not used & set(range(g, g + n))]
            if not starts:
                continue
            if first == 0:   # continuing the previous place's last page: group G-1 then group 0
                prev = rows[size - 1] - groups if size - 1 in rows else None
            else:
                prev = rows.get(first - 1)
            g = prev + 1 if prev is not None and prev + 1 in starts and rng.random() < 0.8 else rng.choice(starts)
            for d, (m, _) in zip(drivers, mirrors):
                d.map_mirrored(m, first * PAGE, g, n)
            rows.update(zip(range(first, first + n), range(g, g + n)))
        joined += rows.get(0) == 0 and rows.get(size - 1) == groups - 1
        if step % 7 == 0 or step > 380:                      # read the tables now and then: lazily synced
            assert books(drivers[0], mirrors[0][1]) == books(drivers[1], mirrors[1][1]), f"step {step}"
        assert drivers[0].stats.num_mappings == drivers[1].stats.num_mappings, f"step {step}"
    assert joined > 0
    for d in drivers:
        d.close()
    assert [getattr(drivers[0].stats, s) for s in STATS] == [getattr(drivers[1].stats, s) for s in STATS]
    assert drivers[0].stats.mapped_pages == 0 and drivers[0].stats.num_mappings == 0


def test_the_ledger_counts_what_the_kernel_maps():
    """Host (per place, VMAs read back by the driver model that test_vmm_host checks against /proc) and the
    accounting ledger agree on mapping counts across places that meet in one range."""
    places, size, groups = 4, 3, 3
    host, acct = HostVirtualMemory(PAGE), AccountingVirtualMemory(PAGE)
    mirrors = []
    for d in (host, acct):
        d.create_store(places * groups)
        spots = layout(d, "single", places, size)
        mirrors.append(d.mirror(spots, size * PAGE, groups))
    script = [("map", 0, 0, 3), ("unmap", 1, 0, 1), ("map", 1, 1, 1), ("unmap", 0, 0, 3), ("map", 2, 0, 1),
              ("map", 0, 2, 1), ("map", 1, 1, 1), ("unmap", 2, 0, 1), ("map", 2, 2, 1)]
    for op, page, group, n in script:
        for d, m in zip((host, acct), mirrors):
            if op == "map":
                d.map_mirrored(m, page * PAGE, group, n)
            else:
                d.unmap_mirrored(m, page * PAGE, n)
        assert host.stats.num_mappings == acct.stats.num_mappings, (op, page, group)
        assert mirrors[0].places[0][0].segments == mirrors[1].places[0][0].segments
    for d in (host, acct):
        d.close()


def test_a_direct_call_on_a_mirrored_range_falls_back_to_per_place_books(caplog):
    acct = AccountingVirtualMemory(PAGE)
    acct.create_store(8)
    spots = layout(acct, "separate", 2, 4)
    mirror = acct.mirror(spots, 4 * PAGE, 4)
    acct.map_mirrored(mirror, 0, 1, 2)
    with caplog.at_level(logging.INFO, logger="kvlab.vmm"):
        acct.unmap(spots[1][0], PAGE)                       # behind the mirror's back
    assert "per place" in caplog.text and acct.stats.per_place_fallbacks == 1 and mirror.books is None
    assert spots[0][0].mapped == {0: 1, 1: 2} and spots[1][0].mapped == {0: 5}
    assert acct.stats.mapped_pages == 3 == sum(acct.store_maps)
    with pytest.raises(DriverError, match="not mapped"):     # per place now: the hole is seen
        acct.unmap_mirrored(mirror, PAGE)
    acct.close()
    assert acct.stats.mapped_pages == 0 and acct.stats.num_mappings == 0


@pytest.mark.parametrize("driver", [AccountingVirtualMemory(PAGE), PerPlace(PAGE)], ids=["ledger", "per-place"])
def test_mirrored_misuse_raises_and_changes_nothing(driver):
    driver.create_store(8)
    spots = layout(driver, "separate", 2, 4)
    with pytest.raises(DriverError, match="overlap"):
        driver.mirror([spots[0], (spots[0][0], PAGE)], 2 * PAGE, 4)
    mirror = driver.mirror(spots, 4 * PAGE, 4)
    driver.map_mirrored(mirror, PAGE, 0, 2)
    before = books(driver, spots)
    with pytest.raises(DriverError, match="already mapped"):
        driver.map_mirrored(mirror, 2 * PAGE, 2, 2)
    with pytest.raises(DriverError, match="not mapped"):
        driver.unmap_mirrored(mirror, 0, 2)
    with pytest.raises(DriverError, match="page-aligned"):
        driver.map_mirrored(mirror, 3 * PAGE, 2, 2)        # past the end of a place
    with pytest.raises(DriverError, match="outside the page store"):
        driver.map_mirrored(mirror, 0, 4, 1)                # place 1 would map pool page 8
    assert books(driver, spots) == before
    driver.close()
