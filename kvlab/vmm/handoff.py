"""The vmm backend's KV handoff: no K/V byte moves. Both engines draw pages from one machine-wide pool
(vmm/pool/); the prefill engine sends the pool page ids behind the sequence's slot (every layer, K and V), the decode
engine moves them to itself in the pool's ledger in one locked step (vmm/pool/transfer.py: the giver must hold them,
the taker's ceiling must allow them, all or nothing), maps them MAP_FIXED into one of its slots, then acks. Only
then does the prefill engine unmap them, without giving them to the pool: they are no longer its own. A refused
transfer leaves them with the prefill engine, which frees the sequence as usual; whatever happened (a decode
engine killed between transfer and ack included) the prefill side reads the owner from the ledger.

The pages move through the allocator's handoff API (`allocator.exports`, vmm/exports.py) and the machine-wide pool's
interface (`MachinePool.handoff_pages`, vmm/drivers/machine_pool.py): this module is the wire side, no books.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import RequestError
from kvlab.common.handoff.seam import Export, HandoffError, HandoffRefused, HandoffReport
from kvlab.common.validate import shown
from kvlab.vmm.pool import PoolError
from kvlab.vmm.pool.transfer import TransferRefused

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.allocator import VMMAllocator


class VMMHandoff:
    unit = "page"
    import_within_ack = True     # the header names pages the giver holds until it stops waiting for the ack

    def __init__(self, cache: KVCache, config: Any) -> None:
        allocator: VMMAllocator = cache.allocator
        self.member = allocator.pool.handoff_pages().member   # ConfigError without a shared pool
        self.allocator, self.exports, self.geo, self.shape = allocator, allocator.exports, allocator.geo, cache.shape
        self.exported: dict[int, tuple[list[int], list[int]]] = {}   # seq_id -> (local pages, pool pages)

    def describe(self) -> dict[str, Any]:
        """The layout both engines must share; the pool's name is checked here, once (check_peer)."""
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

    # -- prefill side ---------------------------------------------------------------------------------------
    def export(self, seq: Sequence, num_tokens: int) -> Export:
        start = time.perf_counter()
        local, pages = self.exports.export(seq.seq_id, num_tokens)
        self.exported[seq.seq_id] = (local, pages)
        header = {"num_tokens": num_tokens, "giver": self.member.index, "giver_pid": os.getpid(), "pages": pages}
        return Export(header, [], HandoffReport(time.perf_counter() - start, 0, len(pages), self.unit))

    def release(self, seq: Sequence, taken: bool | None) -> None:
        """Pages still this engine's (refused, never transferred) are freed as usual; transferred ones are
        unmapped and forgotten. The ledger says which, whatever the ack said."""
        local, pages = self.exported.pop(seq.seq_id, ([], []))
        if pages and not self.member.still_holds(pages):
            self.exports.let_go(seq.seq_id, local)
        self.allocator.free(seq)

    # -- decode side ----------------------------------------------------------------------------------------
    def import_kv(self, seq: Sequence, header: Any, fds: list[int]) -> HandoffReport:
        num_tokens, giver, giver_pid, pages = _read_header(header, fds)
        groups = self.geo.pages_for(num_tokens)
        if len(pages) != groups * self.geo.num_tensors:
            raise HandoffError(f"{len(pages)} pages arrived for {num_tokens} tokens, "
                               f"{groups * self.geo.num_tensors} expected")
        self.exports.receive(seq.seq_id, num_tokens, pages, lambda: self._transfer(giver, giver_pid, pages))
        return HandoffReport(0.0, 0, len(pages), self.unit)

    def _transfer(self, giver: int, giver_pid: int, pages: list[int]) -> None:
        """The giver's pages become this engine's in the pool's ledger, all or nothing (vmm/pool/transfer.py)."""
        try:
            self.member.receive(giver, giver_pid, pages)
        except TransferRefused as exc:
            raise HandoffRefused(str(exc)) from None
        except PoolError as exc:
            raise HandoffError(str(exc)) from None


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
