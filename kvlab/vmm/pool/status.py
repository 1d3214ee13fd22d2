"""A consistent picture of a pool, read under its lock: what `kvlab pool status` prints."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvlab.vmm.pool.engines import EngineRecord
from kvlab.vmm.pool.ledger import HOST, Ledger


@dataclass(frozen=True)
class PoolStatus:
    name: str
    page_size: int
    total: int                  # pages
    free: int
    reserved: int               # free pages promised to engines below their floor
    reclaimed_pages: int        # pages returned from dead engines since the pool was created
    reclaimed_engines: int
    joins: int                  # engines that ever joined, the creator included
    engines: tuple[EngineRecord, ...]
    device: str = "cpu"         # where the pages are: cpu (a memfd) or cuda:N (chunks on that GPU)

    @property
    def used(self) -> int:
        return self.total - self.free

    def engine(self, name: str) -> EngineRecord | None:
        return next((e for e in self.engines if name in (e.name, str(e.pid))), None)

    def to_json(self) -> dict[str, Any]:
        pages = {"total": self.total, "used": self.used, "free": self.free, "reserved": self.reserved}
        return {"name": self.name, "device": self.device, "page_size": self.page_size,
                **{f"{k}_pages": v for k, v in pages.items()},
                **{f"{k}_bytes": v * self.page_size for k, v in pages.items()},
                "reclaimed_pages": self.reclaimed_pages, "reclaimed_engines": self.reclaimed_engines,
                "joins": self.joins,
                "engines": [dataclasses.asdict(e) for e in self.engines]}


def device_text(device: int) -> str:
    return "cpu" if device == HOST else f"cuda:{device}"


def read_status(name: str, ledger: Ledger) -> PoolStatus:
    h = ledger.header
    return PoolStatus(name, int(h["page_size"]), ledger.total, ledger.free, ledger.table.unmet_floors(),
                      int(h["reclaimed_pages"]), int(h["reclaimed_engines"]), int(h["joins"]),
                      tuple(ledger.table.records()), device_text(ledger.device))
