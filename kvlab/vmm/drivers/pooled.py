"""Virtual memory whose physical pages come from a machine-wide pool (vmm/pool/, docs/pool.md), on the host or a GPU.

The driver's books still number its pages 0..n-1 (its "local" pages); each local page is backed by a pool page
only while it is needed. Take before map: a local page without a backing gets one from the ledger (`member.take`)
before it is mapped, and the map puts that pool page at the address (pooled_host.py: the memfd at the page's
offset; pooled_cuda.py: the page's chunk at its offset). Unmapping keeps the backing as a spare (the page's data
stays valid for a remap in the same call, as the driver's repairs expect); a later map of another local page
reuses a spare before taking more, and spares go back to the pool (`member.give`) when another engine asks for
pages (the ledger's `wanted` count) or when the driver closes. Pages holding prefix-cached data are kept
(`keep`): unmapped, they are no spares until the cache evicts them (`let_go`). A refused take raises
PoolExhausted, which the vmm handles as it handles a spent map budget: it unmaps freed slots' pages and tries once
more, then the scheduler preempts.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.base import VirtualMemory
from kvlab.vmm.drivers.map_budget import MapBudgetExhausted, process_budget
from kvlab.vmm.drivers.types import DriverStats, OSMemory, PartialCall, Region
from kvlab.vmm.pool import PoolMember

ANSWER_WAIT_S = 0.5        # at most a few steward rounds (0.1 s each) for other engines to give pages back
ANSWER_POLL_S = 0.01


class PoolExhausted(MapBudgetExhausted):
    """The pool refused pages (short, this engine's ceiling, or other engines' floors): out of room, like out of
    KV; nothing changed."""


class PoolPageMapper(Protocol):
    """A device's part of a pooled driver: one pool page mapped at an address, over the device's own driver calls
    (`memory`: its reservations, unmaps, views and granularity)."""
    name: str
    page_size: int
    memory: OSMemory

    def map_page(self, addr: int, pool_page: int) -> int:
        """Map one pool page read-write at `addr`; the OS calls made. A failure leaves nothing mapped there."""

    def map_run(self, addr: int, pool_page: int, num_pages: int) -> int:
        """Map pool pages [pool_page, + num_pages) at consecutive addresses from `addr`; the OS calls made. A
        failure leaves nothing of the run mapped."""

    def taken(self, pool_pages: list[int]) -> None:
        """Pages new to this engine from the pool: what another engine wrote there must not be read."""

    def gone(self, pool_pages: list[int]) -> None:
        """Pages no longer this engine's (given back, or taken by another engine in a handoff)."""

    def close(self, store_maps: Sequence[int]) -> None: ...


class PooledMemory:
    """The OS calls (`OSMemory`) with pool pages as physical memory: `pages` (pooled_host.py, pooled_cuda.py)
    reserves, views and maps one pool page at an address on its device; this class decides which pool page backs
    which local page. Not thread-safe: the vmm allocator's lock serialises every call, the give-backs included."""

    merges = False            # consecutive local pages sit at unrelated pool offsets

    def __init__(self, member: PoolMember, page_size: int, pages: PoolPageMapper) -> None:
        self.member, self.page_size, self.pages = member, page_size, pages
        self.name = pages.name
        self.unmaps_runs = pages.memory.unmaps_runs   # unmaps are the device driver's own
        self.backing: dict[int, int] = {}     # local page -> pool page
        self.idle: dict[int, None] = {}       # backed local pages no mapping uses, oldest first: the spares
        self.loose: list[int] = []            # pool pages held for maps to come, backing no local page yet
        self.kept: set[int] = set()           # local pages whose data is wanted unmapped too (prefix-cached)
        self.mapped: dict[int, int] = {}      # address -> local page mapped there
        self.refs: dict[int, int] = {}        # local page -> mappings of it
        self.may_wait = True                  # no wait for others' pages yet this engine step
        self.retiring: list[int] = []         # held pool pages a handoff replaced, listed until given back
        self.retire_lock = threading.Lock()   # `retiring` is filled on the engine's thread, given on the steward's
        self.give_lock = threading.Lock()     # one give of the retiring pages at a time

    @property
    def fd(self) -> int:
        """A host pool's memfd, for reading pages beside the mappings (vmm/probe.py), as the host driver's."""
        return self.member.page_fd

    def page_offset(self, page: int) -> int:
        """The memfd offset of the pool page behind local page `page`."""
        return self.member.page_offset(self.backing[page])

    def granularity(self) -> int:
        return self.pages.memory.granularity()

    def reserve(self, nbytes: int) -> int:
        return self.pages.memory.reserve(nbytes)

    def release(self, region: Region) -> None:
        self.pages.memory.release(region)
        for addr in [a for a in self.mapped if region.base <= a < region.base + region.nbytes]:
            self._forget(addr)

    def view(self, region: Region, offset: int, nbytes: int) -> tuple[Any, Any]:
        return self.pages.memory.view(region, offset, nbytes)

    def resize_store(self, old_pages: int, new_pages: int) -> None:
        """Local pages cost nothing until mapped; cut ones (unmapped, checked by the driver) give their pages."""
        self.discard(new_pages, max(0, old_pages - new_pages))

    def map(self, addr: int, first_page: int, num_pages: int) -> int:
        local = range(first_page, first_page + num_pages)
        for page in local:                    # this call's own idle pages are not spares to reuse
            self.idle.pop(page, None)
        try:
            self._back([p for p in local if p not in self.backing])
            return self._map_each(addr, local)
        except BaseException:
            self.idle.update((p, None) for p in local if p in self.backing and not self.refs.get(p)
                             and p not in self.kept)
            raise

    def _map_each(self, addr: int, local: range) -> int:
        """One map call per run of consecutive pool pages behind consecutive local pages (a handoff's pages, a
        fresh take: usually one run)."""
        calls, size = 0, self.page_size
        for i, pool_page, n in pool_runs([self.backing[page] for page in local]):
            try:
                calls += self.pages.map_run(addr + i * size, pool_page, n)
            except PartialCall as e:   # the run's first pages got mapped
                self._book_run(addr, local, i, e.pages_done)
                raise PartialCall(str(e), i + e.pages_done) from e
            except DriverError as e:
                if i:
                    raise PartialCall(str(e), i) from e
                raise
            self._book_run(addr, local, i, n)
        return calls

    def _book_run(self, addr: int, local: range, first: int, count: int) -> None:
        refs, size = self.refs, self.page_size
        for k in range(first, first + count):
            page = local[k]
            self.mapped[addr + k * size] = page
            refs[page] = refs.get(page, 0) + 1

    def _back(self, pages: list[int]) -> None:
        """Give each local page a pool page: loose pages and a take for what the spares do not cover, then the
        oldest spares' pages; all or nothing."""
        self.hold(len(pages))
        for page in pages:
            self.backing[page] = self.loose.pop() if self.loose else self.backing.pop(self.oldest_idle())

    def hold(self, count: int) -> None:
        """Hold pool pages for `count` maps of pages without a backing, all or nothing: a take for what the loose
        pages and the spares do not cover. A refused take asks the other engines for pages (the ledger's
        `wanted`), then raises PoolExhausted with nothing changed."""
        need = count - len(self.idle) - len(self.loose)
        taken = self.member.take(need) if need > 0 else []
        if taken is None:
            taken = self._ask(need)
        self.pages.taken(taken)
        if taken:   # highest first: `_back` pops them lowest first, so fresh pages map in runs
            self.loose.extend(taken)
            self.loose.sort(reverse=True)

    def _ask(self, need: int) -> list[int]:
        """Ask the other engines for pages and wait for their stewards' answer, once per engine step and only
        while some of them published pages they can give; else, or still refused, out of room (the engine
        preempts, as on a spent map budget)."""
        if not self.may_wait or not self.member.others_givable():
            raise PoolExhausted(f"pool {self.member.name!r} refused {need} pages")
        self.may_wait = False
        with self.member.asking(need):   # on leaving, others stop giving (and evicting cached pages) for this ask
            deadline = time.monotonic() + ANSWER_WAIT_S
            while time.monotonic() < deadline:
                time.sleep(ANSWER_POLL_S)
                if (taken := self.member.take(need)) is not None:
                    return taken
                if not self.member.others_givable():      # they gave all they could, to others or to the pool
                    break
        raise PoolExhausted(f"pool {self.member.name!r} refused {need} pages")

    def oldest_idle(self) -> int:
        page = next(iter(self.idle))
        del self.idle[page]
        return page

    def unmap(self, addr: int, num_pages: int) -> int:
        try:
            calls = self.pages.memory.unmap(addr, num_pages)
        except PartialCall as e:
            self._forget(addr, e.pages_done)
            raise
        self._forget(addr, num_pages)
        return calls

    def _forget(self, addr: int, num_pages: int = 1) -> None:
        """The mappings from addr are gone; a local page no longer mapped anywhere keeps its pool page, idle (its
        data stays valid until the page is given or reused, so a repair can map it back)."""
        for i in range(num_pages):
            page = self.mapped.pop(addr + i * self.page_size, None)
            if page is None:
                continue
            self.refs[page] -= 1
            if not self.refs[page]:
                del self.refs[page]
                if page not in self.kept:
                    self.idle[page] = None

    def discard(self, first_page: int, num_pages: int) -> None:
        pages = [p for p in range(first_page, first_page + num_pages) if p in self.idle]
        for page in pages:
            del self.idle[page]
        self.give([self.backing.pop(p) for p in pages])

    def retire(self) -> None:
        """Give back the pages handoffs replaced. The steward thread calls it each round: the punch (about 10 µs a
        page on the host) runs beside the engine's steps, not in a handoff's latency. `member.give` takes its own
        locks; the pages are in no other book of this class. They stay listed until given, so a failed give keeps
        them for the next round and `PoolAccount.holdings` never misses a give under way."""
        with self.give_lock:
            with self.retire_lock:
                pages = list(self.retiring)
            if pages:
                self.member.give(pages)
                with self.retire_lock:
                    del self.retiring[:len(pages)]      # handoffs since have appended theirs

    def give(self, pool_pages: list[int]) -> None:
        if pool_pages:
            self.member.give(pool_pages)
            self.pages.gone(pool_pages)

    def close(self, store_maps: Sequence[int]) -> None:
        try:
            self.pages.close(store_maps)
        finally:
            self.member.close()           # gives back every page still held



class PoolAccount:
    """The engine's account in the machine-wide pool (the allocator's `MachinePool`, vmm/drivers/machine_pool.py):
    room and ceiling from the ledger, holds before maps, the pages the prefix cache keeps, spares given back when
    other engines ask, the stats' pool block, and the pages a KV handoff moves. It works on the pooled memory's
    books of which pool page backs which local page (`memory`)."""
    elastic = True

    def __init__(self, member: PoolMember, memory: PooledMemory, stats: DriverStats) -> None:
        self.member, self.memory, self.driver_stats = member, memory, stats

    def begin_step(self) -> None:
        self.memory.may_wait = True

    def room_pages(self) -> int:
        return self.spare_pages() + self.member.room()

    def ceiling_pages(self) -> int:
        return self.member.record().ceiling

    def hold(self, pages: int) -> None:
        """A change made of several maps takes its pages first. Taking (and waiting for) pool pages is part of
        mapping, as inside a map call: counted as map time."""
        t0 = time.perf_counter()
        try:
            self.memory.hold(pages)
        finally:
            self.driver_stats.map_seconds += time.perf_counter() - t0

    def keep(self, pages: list[int]) -> None:
        memory = self.memory
        memory.kept.update(pages)
        for page in pages:
            memory.idle.pop(page, None)

    def let_go(self, pages: list[int]) -> None:
        """Spares again, oldest last."""
        memory = self.memory
        memory.kept.difference_update(pages)
        memory.idle.update((p, None) for p in pages if p in memory.backing and p not in memory.refs)

    def spare_pages(self) -> int:
        return len(self.memory.loose) + len(self.memory.idle)

    def above_floor(self) -> int:
        record = self.member.record()
        return record.held - record.floor

    def give_spare(self, limit: int) -> int:
        """Loose pages first, then spares, oldest first."""
        memory, limit = self.memory, min(limit, self.above_floor())
        loose, memory.loose = memory.loose[:max(0, limit)], memory.loose[max(0, limit):]
        pages = [memory.oldest_idle() for _ in range(min(limit - len(loose), len(memory.idle)))]
        memory.give(loose + [memory.backing.pop(p) for p in pages])
        return len(loose) + len(pages)

    def answer_asks(self, give_back: Callable[[int], None], givable: Callable[[], int]) -> None:
        self.member.serve(give_back, givable, every_round=self.memory.retire)

    def stats(self) -> dict[str, Any]:
        """The pool's size and use, this engine's share and its page moves."""
        free, record = self.member.books()
        size, total = self.member.page_size, self.member.total_pages
        return {"name": self.member.name, "total_bytes": total * size, "used_bytes": (total - free) * size,
                "engine_bytes": record.held * size, "pages_given": record.given, "pages_taken": record.taken}

    # -- the KV handoff's pages (vmm/handoff.py) ------------------------------------------------------------------
    def handoff_pages(self) -> PoolAccount:
        return self

    def pool_page(self, local: int) -> int:
        """The pool page behind a mapped local page."""
        return self.memory.backing[local]

    def holdings(self) -> tuple[list[int], int]:
        """The pool pages this engine's books hold (backing, loose, retiring) and how many the ledger says it holds,
        read with no give of retiring pages under way: the two agree whenever the engine's thread is between
        calls (tests and audits compare them)."""
        memory = self.memory
        with memory.give_lock, memory.retire_lock:
            return [*memory.backing.values(), *memory.loose, *memory.retiring], self.member.record().held

    def make_room(self, count: int) -> None:
        """Before receiving `count` pages: if the engine's ceiling would refuse them, give back now what earlier
        handoffs replaced (the steward gives it within a round anyway), so those never refuse a transfer."""
        record = self.member.record()
        if record.held + count > record.ceiling:
            self.memory.retire()

    def adopt(self, pages: dict[int, int]) -> None:
        """Back these unmapped local pages with pool pages this engine just received (their data stays); the next
        map of them maps the received pages. A page's old, idle backing goes back to the pool from the steward's
        thread (`PooledMemory.retire`): on the host, zeroing it is a punch of ~10 µs a page, as long as the map."""
        memory = self.memory
        if any(local in memory.refs for local in pages):
            raise DriverError("vmm handoff: cannot adopt pool pages into local pages that are mapped")
        old = [memory.backing[local] for local in pages if local in memory.backing]
        for local, pool_page in pages.items():
            memory.idle.pop(local, None)
            memory.backing[local] = pool_page
        memory.pages.gone(old)
        with memory.retire_lock:
            memory.retiring.extend(old)

    def disown(self, locals_: list[int]) -> None:
        """Forget the pool pages behind these unmapped local pages: another engine took them (no give, they are not
        this engine's any more)."""
        memory = self.memory
        if any(local in memory.refs for local in locals_):
            raise DriverError("vmm handoff: cannot disown local pages that are still mapped")
        for local in locals_:
            memory.idle.pop(local, None)
            memory.kept.discard(local)
        gone = [memory.backing.pop(local) for local in locals_]
        memory.pages.gone(gone)
        self.member.forget(gone)

    def give_unadopted(self, pages: list[int]) -> None:
        """After a failed import: received pages no local page adopted go back to the pool (adopted ones are this
        engine's idle spares, given back as any spare is)."""
        adopted = set(self.memory.backing.values())
        if unadopted := [p for p in pages if p not in adopted]:
            self.member.give(unadopted)


class PooledVirtualMemory(VirtualMemory):
    """Virtual memory over pool `pool` (joined, or created with `pool_bytes` if it does not exist) on `device`
    (cpu, or cuda[:N]; `driver`: the cuda.bindings driver module or a fake), in the books as `backend`-PID-TAG;
    `self.pool` is its account there."""

    def __init__(self, pool: str, page_size: int, pool_bytes: int | None = None, device: str = "cpu",
                 populate: bool = True, driver: Any = None, backend: str = "vmm") -> None:
        if device.split(":")[0] == "cpu":
            from kvlab.vmm.drivers.pooled_host import host_pool_pages
            member, pages = host_pool_pages(pool, pool_bytes, page_size, populate, backend)
            budget = process_budget()
        else:
            from kvlab.vmm.drivers.pooled_cuda import cuda_pool_pages
            member, pages, budget = *cuda_pool_pages(pool, pool_bytes, page_size, device, driver, backend), None
        memory = PooledMemory(member, pages.page_size, pages)
        super().__init__(memory, pages.page_size, None, budget)
        self.member = member
        self.pool = PoolAccount(member, memory, self.stats)


def pool_runs(pool_pages: list[int]) -> list[tuple[int, int, int]]:
    """(index, first pool page, length) of each run of consecutive pool pages in `pool_pages`."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(pool_pages) + 1):
        if i == len(pool_pages) or pool_pages[i] != pool_pages[i - 1] + 1:
            runs.append((start, pool_pages[start], i - start))
            start = i
    return runs
