"""The serving tap of an engine on the shared pool: the pages other engines unmapped to give it room are charged in
its step (it waited for them), and the pages it unmapped for others are not (their asker pays)."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.pool.shared import PooledAccountingMemory
from kvlab.experiments.sim.serve.costs import CostLedger
from kvlab.experiments.sim.serve.tap import ServeTap


class PoolTap(ServeTap):
    def __init__(self, runner: Any, cache: Any, ledger: CostLedger, watch: Any = None, layers_per_page: int = 1
                 ) -> None:
        driver = getattr(cache.allocator, "driver", None)
        self.share = driver.budget if isinstance(driver, PooledAccountingMemory) else None
        super().__init__(runner, cache, ledger, watch, layers_per_page)

    def _counters(self) -> tuple[int, int, int]:
        mapped, calls, unmapped = super()._counters()
        if self.share is None:
            return mapped, calls, unmapped
        return mapped, calls, unmapped + self.share.unmapped_for_me - self.share.unmapped_for_others
