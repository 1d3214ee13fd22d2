"""The pool's books (vmm/pool/ledger.py) and one process's membership: take is all or nothing, ceilings and floors,
give refuses what is not held, a change interrupted by death is recounted, and joining, limits and errors."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from fakes.page_window import PageWindow

from kvlab.vmm import pool
from kvlab.vmm.pool.ledger import FREE, Ledger, ledger_bytes
from kvlab.vmm.pool.memory import runs

PAGE = 4096


def books(total: int = 16, engines: int = 4) -> Ledger:
    buf = bytearray(ledger_bytes(total, engines))
    Ledger.format(buf, PAGE, total, engines)
    return Ledger(buf)


def two_engines(total: int = 16) -> Ledger:
    ledger = books(total)
    ledger.register(0, 100, "a", 0, total)
    ledger.register(1, 101, "b", 0, total)
    return ledger


def test_take_is_all_or_nothing():
    ledger = two_engines()
    assert ledger.take(0, 10).tolist() == list(range(10))
    assert ledger.take(1, 7) is None                     # 6 free: nothing changes
    assert (ledger.free, ledger.table.record(1).held, ledger.table.record(1).taken) == (6, 0, 0)
    assert ledger.take(1, 6).tolist() == list(range(10, 16))
    assert ledger.free == 0 and ledger.take(0, 1) is None


def test_take_gives_the_lowest_free_pages():
    ledger = two_engines()
    ledger.take(0, 10)
    ledger.give(0, np.array([7, 2]))
    assert ledger.take(1, 3).tolist() == [2, 7, 10]


def test_counts_that_disagree_with_the_owner_array_refuse_and_recount():
    ledger = two_engines()
    ledger.header["hint"] = 16            # as if every page were owned
    with pytest.raises(pool.PoolError, match="books disagree"):
        ledger.take(0, 1)
    assert ledger.header["dirty"] == 1
    ledger.recount()
    assert ledger.take(0, 1).tolist() == [0]


def test_a_ceiling_caps_one_engine():
    ledger = two_engines()
    ledger.set_limits(0, 0, 4)
    assert ledger.take(0, 5) is None
    assert len(ledger.take(0, 4)) == 4 and ledger.take(0, 1) is None
    assert len(ledger.take(1, 12)) == 12


def test_a_floor_keeps_pages_for_its_engine():
    ledger = two_engines()
    ledger.set_limits(1, 6, 16)
    assert ledger.take(0, 11) is None                    # would leave 5 of b's 6
    assert len(ledger.take(0, 10)) == 10
    assert ledger.table.unmet_floors() == 6 and len(ledger.take(1, 6)) == 6


def test_give_refuses_pages_not_held_and_changes_nothing():
    ledger = two_engines()
    mine, theirs = ledger.take(0, 3), ledger.take(1, 2)
    for bad in (theirs, np.array([mine[0], mine[0]]), np.array([99])):
        with pytest.raises(pool.PoolError):
            ledger.give(0, np.concatenate([mine, bad]))
    assert ledger.table.record(0).held == 3 and ledger.free == 11
    ledger.give(0, mine)
    assert (ledger.table.record(0).held, ledger.table.record(0).given, ledger.free) == (0, 3, 14)


@pytest.mark.parametrize("floor, ceiling, fragment", [(5, 4, "floor <= ceiling"), (0, 17, "<= the pool's 16"),
                                                      (-1, 4, "0 <="), (11, 16, "does not fit")])
def test_limits_that_do_not_fit_are_refused(floor, ceiling, fragment):
    ledger = two_engines()
    ledger.set_limits(1, 6, 16)
    with pytest.raises(pool.LimitError, match=fragment):
        ledger.set_limits(0, floor, ceiling)
    assert (ledger.table.record(0).floor, ledger.table.record(0).ceiling) == (0, 16)


def test_books_left_dirty_by_a_dead_writer_are_recounted():
    ledger = two_engines()
    ledger.take(0, 4)
    with pytest.raises(KeyboardInterrupt), ledger.changing():   # a writer stopped between marking and counting
        ledger.owner[4:7] = 1
        ledger.owner[8] = 3                   # and a page of a slot no one uses
        raise KeyboardInterrupt
    assert ledger.header["dirty"] == 1
    ledger.recount()
    assert (ledger.table.record(0).held, ledger.table.record(1).held, ledger.free) == (4, 3, 9)
    assert ledger.owner[8] == FREE and ledger.header["dirty"] == 0


def test_unregister_frees_the_slot_and_its_pages():
    ledger = two_engines()
    ledger.take(1, 5)
    assert ledger.unregister(1) == 5
    assert ledger.table.live_slots() == [0] and ledger.free == 16 and ledger.table.find("b") is None


def test_runs_group_consecutive_pages():
    assert list(runs([7, 1, 2, 3, 9, 8])) == [(1, 3), (7, 3)]
    assert list(runs([])) == []


def test_members_take_give_and_map_in_one_process():
    name = f"test-unit-{os.getpid()}"
    with pool.create(name, 8 * PAGE, PAGE, engine="a") as a, pool.join(name, engine="b", floor=2 * PAGE) as b:
        window = PageWindow(PAGE, 2)
        pages = a.take(6)
        assert pages == list(range(6)) and a.take(1) is None   # b's floor keeps the last 2
        window.map(0, a.page_fd, a.page_offset(pages[5]))
        window.view(0)[:5] = b"hello"
        assert os.pread(b.page_fd, 5, b.page_offset(5)) == b"hello"   # one memfd, seen from both
        window.unmap(0)
        a.give([5])
        assert os.pread(b.page_fd, 5, b.page_offset(5)) == bytes(5)   # given pages are punched: zeros
        assert b.take(3) == [5, 6, 7]
        status = pool.status(name)
        assert (status.used, status.engine("a").held, status.engine("b").held) == (8, 5, 3)
        window.close()
    with pytest.raises(pool.UnknownPool):
        pool.status(name)


def test_set_limits_by_name_and_excess():
    name = f"test-limit-{os.getpid()}"
    with pool.create(name, 8 * PAGE, PAGE, engine="a") as a:
        a.take(6)
        record = pool.set_limits(name, "a", ceiling=4 * PAGE)
        now = a.record()                                  # the pages held above the ceiling: to give back
        assert (record.ceiling, max(0, now.held - now.ceiling), a.take(1)) == (4, 2, None)
        assert pool.set_limits(name, str(a.pid), floor=PAGE).floor == 1
        with pytest.raises(pool.LimitError, match="multiple of the pool's page size"):
            pool.set_limits(name, "a", ceiling=PAGE + 1)
        with pytest.raises(pool.PoolError, match="no engine 'zz'"):
            pool.set_limits(name, "zz", ceiling=PAGE)


@pytest.mark.parametrize("call, error, fragment", [
    (lambda n: pool.create(n, 8 * PAGE + 1, PAGE), pool.LimitError, "multiple of the page size"),
    (lambda n: pool.create(n, 8 * PAGE, 1000), pool.LimitError, "multiple of the OS page"),
    (lambda n: pool.create("bad name", 8 * PAGE, PAGE), pool.PoolError, "bad pool name"),
    (lambda n: pool.join(n + "-none"), pool.UnknownPool, "no pool named"),
    (lambda n: pool.create(n, 8 * PAGE, PAGE), pool.PoolExists, "already exists"),
    (lambda n: pool.join(n, engine="first"), pool.PoolError, "already in the pool"),
    (lambda n: pool.join(n, engine="x", floor=9 * PAGE), pool.LimitError, "<= the pool's 8"),
])
def test_errors_are_one_line(call, error, fragment):
    name = f"test-err-{os.getpid()}"
    with pool.create(name, 8 * PAGE, PAGE, engine="first"):
        with pytest.raises(error, match=fragment) as info:
            call(name)
        assert "\n" not in str(info.value)
        assert pool.status(name).engines[0].name == "first"       # a failed join leaves no trace


def test_a_member_refuses_bad_calls_and_use_after_close():
    name = f"test-use-{os.getpid()}"
    member = pool.create(name, 8 * PAGE, PAGE)
    with pytest.raises(pool.PoolError, match="page count"):
        member.take(0)
    with pytest.raises(pool.PoolError, match="distinct pages it holds"):
        member.give([3])
    with pytest.raises(pool.PoolError, match="not in pool"):
        member.page_offset(8)
    member.close()
    member.close()                                   # twice is fine
    with pytest.raises(pool.PoolError, match="has left"):
        member.take(1)


def test_a_closed_member_leaves_no_descriptor_or_mapping():
    fds_before = set(os.listdir("/proc/self/fd"))
    name = f"test-fds-{os.getpid()}"
    with pool.create(name, 8 * PAGE, PAGE) as a, pool.join(name) as b:
        a.take(2)
        b.take(2)
        pool.status(name)
    assert no_fds_beyond(fds_before)
    assert f"kvlab-pool-{name}" not in Path("/proc/self/maps").read_text()
    assert f"kvlab-pool-{name}" not in Path("/proc/net/unix").read_text()


def no_fds_beyond(before: set[str], wait_s: float = 2.0) -> bool:
    """No descriptor beyond `before` stays open: the pool's server thread closes the connection it accepted for a
    refused join on its own time, so a descriptor still open is waited for a little (a leak stays)."""
    deadline = time.monotonic() + wait_s
    while set(os.listdir("/proc/self/fd")) - before and time.monotonic() < deadline:
        time.sleep(0.02)
    return set(os.listdir("/proc/self/fd")) <= before


def test_books_of_another_version_are_refused_with_nothing_left_open():
    name = f"test-version-{os.getpid()}"
    with pool.create(name, 8 * PAGE, PAGE) as member:
        fds_before = set(os.listdir("/proc/self/fd"))
        header = member._attachment.ledger.header
        header["version"] += 1
        with pytest.raises(pool.PoolError, match="another kvlab version"):
            pool.join(name)
        header["version"] -= 1
        assert no_fds_beyond(fds_before)
