"""The pooled driver maps each run of consecutive pool pages (at consecutive local pages) with one OS call."""
from __future__ import annotations

import ctypes
import os

from helpers.pool_engines import PAGE, pool_name

from kvlab.vmm import pool
from kvlab.vmm.drivers.pooled import PooledVirtualMemory, pool_runs


def test_pool_runs_splits_where_pool_pages_stop_being_consecutive():
    assert pool_runs([]) == []
    assert pool_runs([7]) == [(0, 7, 1)]
    assert pool_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]


def test_fresh_pages_map_in_one_call_and_keep_their_bytes_at_their_pool_offsets():
    with pool.create(pool_name(), 64 * PAGE, page_size=PAGE, engine="other") as other:
        vm = PooledVirtualMemory(other.name, PAGE)
        try:
            vm.create_store(16)
            region = vm.reserve(16 * PAGE)
            vm.map(region, 0, 0, 8)
            assert vm.stats.map_calls == 1                       # 8 fresh pool pages, taken lowest first: one run
            backing = [vm.pool.pool_page(p) for p in range(8)]
            assert backing == list(range(backing[0], backing[0] + 8))
            for p in range(8):                                   # each local page shows its own pool page
                ctypes.c_uint64.from_address(region.base + p * PAGE).value = 1000 + p
            fd_bytes = [int.from_bytes(pool_bytes(vm, backing[p]), "little") for p in range(8)]
            assert fd_bytes == [1000 + p for p in range(8)]
            vm.unmap(region, 0, 8)
            vm.map(region, 8 * PAGE, 0, 1)                      # a remap of pages that are not one run
            vm.map(region, 10 * PAGE, 2, 3)
            assert vm.stats.map_calls == 3
            assert ctypes.c_uint64.from_address(region.base + 11 * PAGE).value == 1003
        finally:
            vm.close()


def pool_bytes(vm: PooledVirtualMemory, pool_page: int) -> bytes:
    return os.pread(vm.member.page_fd, 8, vm.member.page_offset(pool_page))
