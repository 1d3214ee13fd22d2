"""Pages changing owner between two engines of a pool (the KV handoff, issue 30): one locked step on the books that
checks the giver holds every page and the taker's ceiling, then moves them all, or changes nothing. The memory is
not touched: the taker maps the pages where they are (their data stays), and the giver unmaps them without giving
them back (they are no longer its own). If the taker dies, the pages are reaped with its slot, like any it held."""
from __future__ import annotations

import numpy as np

from kvlab.vmm.pool.errors import PoolError
from kvlab.vmm.pool.ledger import Ledger


class TransferRefused(PoolError):
    """The taker cannot hold the pages (its ceiling): nothing changed, the giver still holds them."""


def transfer(ledger: Ledger, giver: int, giver_pid: int, taker: int, pages: np.ndarray) -> None:
    """Inside the pool lock: `pages` of engine slot `giver` (process `giver_pid`) become `taker`'s, all or none."""
    if len(np.unique(pages)) != len(pages) or not np.all((pages >= 0) & (pages < ledger.total)):
        raise PoolError(f"a transfer takes distinct page ids in [0, {ledger.total}), got {pages.tolist()[:8]}")
    if not 0 <= giver < len(ledger.engines) or int(ledger.engines[giver]["pid"]) != giver_pid:
        raise PoolError(f"the giving engine (pid {giver_pid}) has left the pool")
    if not np.all(ledger.owner[pages] == giver):
        raise PoolError(f"the giving engine no longer holds {int(np.sum(ledger.owner[pages] != giver))} of the "
                        f"{len(pages)} pages")
    given, taken = ledger.engines[giver], ledger.engines[taker]
    if taken["held"] + len(pages) > taken["ceiling"]:
        raise TransferRefused(f"taking {len(pages)} pages would pass this engine's pool ceiling "
                              f"({int(taken['ceiling'])} pages, {int(taken['held'])} held)")
    with ledger.changing():
        ledger.owner[pages] = taker
        given["held"] -= len(pages)
        given["given"] += len(pages)
        taken["held"] += len(pages)
        taken["taken"] += len(pages)


def all_held(ledger: Ledger, slot: int, pages: np.ndarray) -> bool:
    return bool(np.all(ledger.owner[pages] == slot))
