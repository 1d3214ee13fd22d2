"""The one interface between the vmm allocator and a machine-wide page pool (vmm/pool/, docs/pool.md), and the
do-nothing pool of a driver whose memory is its own (`NO_POOL`). The allocator asks a driver for nothing else about
pools: every driver has a `pool` (vmm/drivers/base.py), the pooled driver's is its account in the shared pool
(`PoolAccount`, vmm/drivers/pooled.py). Counts are in the driver's pages (one page of one of the 2L tensors)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvlab.common.errors import ConfigError

UNBOUNDED = 1 << 62   # the room of memory no other engine shares: never the limit


class Membership(Protocol):
    """What the handoff asks of the engine's membership in the pool (vmm/pool/member.py's PoolMember)."""
    name: str
    index: int          # the engine's row in the pool's books

    def receive(self, giver: int, giver_pid: int, pages: list[int]) -> None: ...

    def still_holds(self, pages: list[int]) -> bool: ...


class HandoffPages(Protocol):
    """What the KV handoff needs of a pool (vmm/handoff.py): the engine's membership and the pool page behind
    each local page; pages received from another engine are adopted, pages it took are disowned."""
    member: Membership

    def pool_page(self, local: int) -> int: ...

    def make_room(self, count: int) -> None: ...

    def adopt(self, pages: dict[int, int]) -> None: ...

    def disown(self, locals_: list[int]) -> None: ...

    def give_unadopted(self, pages: list[int]) -> None: ...


class MachinePool(Protocol):
    """An engine's account in a machine-wide pool. `elastic`: other engines hold memory that comes back, so the
    engine's capacity is what the pool can give it now (room), and a shortage within its ceiling passes."""
    elastic: bool

    def begin_step(self) -> None:
        """An engine step starts: a refused hold may wait for other engines once more."""

    def room_pages(self) -> int:
        """Pages the next maps can have now: spares, and what the pool can give within the engine's ceiling."""

    def ceiling_pages(self) -> int:
        """The most pages the engine may hold."""

    def hold(self, pages: int) -> None:
        """Make sure the next maps of `pages` pages without a backing cannot be refused (all or nothing;
        PoolExhausted, a MapBudgetExhausted, if refused)."""

    def keep(self, pages: list[int]) -> None:
        """Local pages holding prefix-cached data: unmapped, they are no spares while the cache keeps them."""

    def let_go(self, pages: list[int]) -> None:
        """The cache evicted them: unmapped, they are spares again."""

    def spare_pages(self) -> int:
        """Pool pages held that no mapping uses and no cache keeps."""

    def above_floor(self) -> int:
        """Pages held above the engine's floor: the most it may give back."""

    def give_spare(self, limit: int) -> int:
        """Give back up to `limit` spare pages, never below the floor; returns how many went."""

    def answer_asks(self, give_back: Callable[[int], None], givable: Callable[[], int]) -> None:
        """While other engines want pages call `give_back(pages)` (from the pool's steward thread), and each steward
        round publish `givable()` (the pages the engine could give if asked)."""

    def stats(self) -> dict[str, Any]:
        """The pool block of the cache stats ({} when there is no pool)."""

    def handoff_pages(self) -> HandoffPages:
        """The pages a KV handoff moves between engines (ConfigError when there is no pool)."""


class NoPool:
    """The memory is the driver's own: unbounded room, nothing to hold, keep, give or report."""
    elastic = False

    def begin_step(self) -> None:
        pass

    def room_pages(self) -> int:
        return UNBOUNDED

    def ceiling_pages(self) -> int:
        return UNBOUNDED

    def hold(self, pages: int) -> None:
        pass

    def keep(self, pages: list[int]) -> None:
        pass

    def let_go(self, pages: list[int]) -> None:
        pass

    def spare_pages(self) -> int:
        return 0

    def above_floor(self) -> int:
        return 0

    def give_spare(self, limit: int) -> int:
        return 0

    def answer_asks(self, give_back: Callable[[int], None], givable: Callable[[], int]) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def handoff_pages(self) -> HandoffPages:
        raise ConfigError("kv_role prefill/decode on vmm moves pages between engines through a shared pool: "
                          "give both engines the same kv_pool")


NO_POOL = NoPool()
