"""What a process outside the pool can do by name: read its status and change an engine's limits. It attaches
for the call only and takes no engine slot."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvlab.vmm.pool import rendezvous
from kvlab.vmm.pool.attachment import Attachment
from kvlab.vmm.pool.engines import EngineRecord
from kvlab.vmm.pool.errors import LimitError, PoolError
from kvlab.vmm.pool.ledger import Ledger, to_pages
from kvlab.vmm.pool.status import PoolStatus, read_status


@contextlib.contextmanager
def books(name: str) -> Iterator[tuple[Attachment, Ledger]]:
    """The pool's books under its lock, dead engines' pages already returned."""
    attachment = Attachment(name, *rendezvous.fetch(name))
    try:
        with attachment.locked() as ledger:
            attachment.reap(ledger)
            yield attachment, ledger
    finally:
        attachment.close()


def status(name: str) -> PoolStatus:
    with books(name) as (_, ledger):
        return read_status(name, ledger)


def set_limits(name: str, engine: str, floor: int | None = None, ceiling: int | None = None) -> EngineRecord:
    """Change a live engine's floor and/or ceiling (bytes; None keeps it). A lowered ceiling refuses the engine's
    takes until it has given back below it; a raised floor is honoured as pages come free (no other engine may
    take while free pages do not cover the floors not yet met)."""
    for what, value in (("floor", floor), ("ceiling", ceiling)):
        if value is not None and type(value) is not int:
            raise LimitError(f"{what} must be an integer number of bytes, got {str(value)[:40]!r}")
    with books(name) as (attachment, ledger):
        slot = ledger.table.find(engine)
        if slot is None:
            names = ", ".join(r.name for r in ledger.table.records()) or "none"
            raise PoolError(f"pool {name!r} has no engine {engine!r} (engines: {names})")
        old = ledger.table.record(slot)
        size = attachment.page_size
        ledger.set_limits(slot, old.floor if floor is None else to_pages(floor, size, "floor"),
                          old.ceiling if ceiling is None else to_pages(ceiling, size, "ceiling"))
        return ledger.table.record(slot)
