"""The vmm backend's KV handoff: no K/V byte moves. Both engines draw pages from one machine-wide pool
(vmm/pool/); the prefill engine sends the pool page ids behind the sequence's slot (every layer, K and V), the decode
engine moves them to itself in the pool's ledger in one locked step (vmm/pool/transfer.py: the giver must hold them,
the taker's ceiling must allow them, all or nothing), maps them MAP_FIXED into one of its slots, then acks. Only
then does the prefill engine unmap them, without giving them to the pool: they are no longer its own. A refused
transfer leaves them with the prefill engine, which frees the sequence as usual; whatever happened (a decode
engine killed between transfer and ack included) the prefill side reads the owner from the ledger.

The driver's pooled OS layer offers the page interface used here (`PooledPages`: pool_page, adopt, disown, and the
pool membership); a CUDA pooled memory plugs in by offering the same.
"""
from __future__ import annotations

import os
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.common.errors import ConfigError, RequestError
from kvlab.common.handoff.seam import Export, HandoffError, HandoffRefused, HandoffReport
from kvlab.common.validate import shown
from kvlab.vmm.pool import PoolError
from kvlab.vmm.pool.transfer import TransferRefused

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.allocator import VMMAllocator
    from kvlab.vmm.pool import PoolMember
    from kvlab.vmm.slots import Slot


class PooledPages(Protocol):
    """What the handoff needs of a pooled driver's OS layer (vmm/drivers/pooled.py)."""
    member: PoolMember
    backing: dict[int, int]          # local page -> the pool page behind it

    def pool_page(self, local: int) -> int: ...

    def adopt(self, pages: dict[int, int]) -> None: ...

    def disown(self, locals_: list[int]) -> None: ...


class VMMHandoff:
    unit = "page"

    def __init__(self, cache: KVCache, config: Any) -> None:
        allocator: VMMAllocator = cache.allocator
        if not hasattr(allocator.driver, "member"):
            raise ConfigError("kv_role prefill/decode on vmm moves pages between engines through a shared pool: "
                              "give both engines the same kv_pool")
        self.allocator, self.geo, self.shape = allocator, allocator.geo, cache.shape
        self.os: PooledPages = allocator.driver.os
        self.member = self.os.member
        self.stride = allocator.ranges.mirror.pool_stride
        self.exported: dict[int, tuple[list[int], list[int]]] = {}   # seq_id -> (local pages, pool pages)

    def describe(self) -> dict[str, Any]:
        s, g = self.shape, self.geo
        return {"unit": self.unit, "pool": self.member.name, "page_size": g.page_size,
                "tokens_per_page": g.tokens_per_page, "num_tensors": g.num_tensors, "num_layers": s.num_layers,
                "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "cache_dtype": str(s.cache_dtype)}

    def params(self) -> dict[str, Any]:
        return {"pool": self.member.name}

    def check_params(self, kv: dict[str, Any]) -> None:
        """The pool check, once, as the decode request arrives: the pages must live in this engine's pool."""
        if kv.get("pool") != self.member.name:
            raise RequestError(f"the KV lives in pool {shown(kv.get('pool'))} but this decode engine is on pool "
                               f"{self.member.name!r}: run both roles on the same kv_pool")

    def check_peer(self, layout: Any) -> None:
        mine = self.describe()
        if layout != mine:
            raise HandoffError(f"the decode engine's KV layout {layout} differs from this engine's {mine}: run "
                               "both roles with the same model, KV dtype, page size and pool")

    def _locals(self, groups: list[int]) -> list[int]:
        """The local pages of these groups in every tensor, tensor by tensor (the order pages travel in)."""
        return [g + i * self.stride for i in range(self.geo.num_tensors) for g in groups]

    # -- prefill side ---------------------------------------------------------------------------------------
    def export(self, seq: Sequence, num_tokens: int) -> Export:
        start = time.perf_counter()
        with self.allocator._lock:
            slot = self.allocator.table.of(seq.seq_id)
            if slot.dropped:
                raise HandoffError("a sliding window unmapped this sequence's first pages: it cannot be handed off")
            locals_ = self._locals(slot.groups[:self.geo.pages_for(num_tokens)])
            pages = [self.os.pool_page(p) for p in locals_]
        self.exported[seq.seq_id] = (locals_, pages)
        header = {"num_tokens": num_tokens, "giver": self.member.slot, "giver_pid": os.getpid(), "pages": pages}
        return Export(header, [], HandoffReport(time.perf_counter() - start, 0, len(pages), self.unit))

    def release(self, seq: Sequence, taken: bool | None) -> None:
        """Pages still this engine's (refused, never transferred) are freed as usual; transferred ones are
        unmapped and forgotten. The ledger says which, whatever the ack said."""
        locals_, pages = self.exported.pop(seq.seq_id, ([], []))
        if pages and not self.member.still_holds(pages):
            with self.allocator._lock:
                slot = self.allocator.table.of(seq.seq_id)
                with self.allocator.table.accounting(slot):
                    self.allocator.pages.drop_tail(slot, len(slot.groups))
                self.os.disown(locals_)
        self.allocator.free(seq)

    # -- decode side ----------------------------------------------------------------------------------------
    def import_kv(self, seq: Sequence, header: Any, fds: list[int]) -> HandoffReport:
        num_tokens, giver, giver_pid, pages = _read_header(header, fds)
        groups = self.geo.pages_for(num_tokens)
        if len(pages) != groups * self.geo.num_tensors:
            raise HandoffError(f"{len(pages)} pages arrived for {num_tokens} tokens, "
                               f"{groups * self.geo.num_tensors} expected")
        with self.allocator._lock:
            if not self.allocator.table.has_free():
                raise HandoffRefused("no free vmm slot for the imported KV")
            self._receive(giver, giver_pid, pages)
            fill = partial(self._map_received, groups, pages, num_tokens)
            try:
                self.allocator.pages.new_slot(seq.seq_id, num_tokens, fill, fewest_pages=True)
            except BaseException:
                self._give_unadopted(pages)
                raise
        return HandoffReport(0.0, 0, len(pages), self.unit)

    def _give_unadopted(self, pages: list[int]) -> None:
        """After a failed import: received pages no local page adopted go back to the pool (adopted ones are this
        engine's idle spares, given back as any spare is)."""
        adopted = set(self.os.backing.values())
        if unadopted := [p for p in pages if p not in adopted]:
            self.member.give(unadopted)

    def _receive(self, giver: int, giver_pid: int, pages: list[int]) -> None:
        try:
            self.member.receive(giver, giver_pid, pages)
        except TransferRefused as exc:
            raise HandoffRefused(str(exc)) from None
        except PoolError as exc:
            raise HandoffError(str(exc)) from None

    def _map_received(self, count: int, pages: list[int], num_tokens: int, slot: Slot) -> None:
        """Fill a just-claimed slot: its stale pages go, `count` page groups are taken and backed by the received
        pool pages, then mapped (the slot's first pages hold the prompt's K/V as the prefill engine wrote them)."""
        table, slot_pages = self.allocator.table, self.allocator.pages
        with table.accounting(slot):
            slot_pages.drop_tail(slot, len(slot.groups))
        groups = slot_pages._obtain(count, slot, keep=count, prefer=None)
        self.os.adopt(dict(zip(self._locals(groups), pages)))
        with table.accounting(slot):
            slot_pages.maps.append(slot, groups, shared=False)
            slot.held = num_tokens


def _read_header(header: Any, fds: list[int]) -> tuple[int, int, int, list[int]]:
    try:
        values = int(header["num_tokens"]), int(header["giver"]), int(header["giver_pid"])
        pages = [int(p) for p in header["pages"]]
    except (TypeError, KeyError, ValueError):
        raise HandoffError(f"a malformed KV header from the prefill engine: {str(header)[:120]}") from None
    if fds:
        raise HandoffError(f"the vmm KV came with {len(fds)} descriptors, none expected")
    return (*values, pages)


def make(cache: KVCache, config: Any) -> VMMHandoff:
    return VMMHandoff(cache, config)
