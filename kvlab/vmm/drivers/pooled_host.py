"""A pooled driver's host part: pool pages are pages of the pool's memfd, mapped MAP_FIXED|MAP_SHARED at their
offset into the engine's own reservations (the host driver's reserve, release and views). The pool punches what
engines give back, so a page new to an engine reads zeros without work here."""
from __future__ import annotations

from collections.abc import Sequence

from kvlab.vmm.drivers.host import HostMemory
from kvlab.vmm.libc import MAP_FIXED, MAP_POPULATE, MAP_SHARED, PROT_RW
from kvlab.vmm.pool import PoolMember, join_or_create


class HostPoolPages:
    name = "host"

    def __init__(self, member: PoolMember, page_size: int, populate: bool = True) -> None:
        self.member, self.page_size = member, page_size
        self.memory = HostMemory(page_size, populate)     # reservations, views, unmaps: one mmap, all or nothing
        self.flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if populate else 0)

    def map_page(self, addr: int, pool_page: int) -> int:
        self.memory.mmap_at("map pool pages", addr, self.page_size, PROT_RW, self.flags,
                            self.member.page_fd, self.member.page_offset(pool_page))
        return 1

    def map_run(self, addr: int, pool_page: int, num_pages: int) -> int:
        self.member.page_offset(pool_page + num_pages - 1)   # the whole run lies in the pool (raises if not)
        self.memory.mmap_at("map pool pages", addr, num_pages * self.page_size, PROT_RW, self.flags,
                            self.member.page_fd, self.member.page_offset(pool_page))
        return 1

    def taken(self, pool_pages: list[int]) -> None:
        """Punched by their giver (or by the reaper of a dead one): zeros already."""

    def gone(self, pool_pages: list[int]) -> None:
        """The pool punches them when given; a handoff's taker wants their data."""

    def close(self, store_maps: Sequence[int]) -> None:
        self.memory.close(store_maps)


def host_pool_pages(pool: str, nbytes: int | None, page_size: int, populate: bool,
                    backend: str = "vmm") -> tuple[PoolMember, HostPoolPages]:
    member = join_or_create(pool, nbytes, page_size, backend=backend)
    try:
        return member, HostPoolPages(member, page_size, populate)
    except BaseException:
        member.close()
        raise
