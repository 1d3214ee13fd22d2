"""Each server's bytes in a shared pool over time, read from the pool's books (`kvlab.vmm.pool.status`) every
~0.2 s in a thread. The books are the truth at every moment; a server's /kvlab/stats `pool` block is refreshed
only when its engine steps, so an idle engine that gave its pages away still shows its last step's bytes there.
A pool engine is the server's engine process, a child of the `kvlab serve` process: it is matched by parent pid.
The series have the shape of loadgen/sampler.py's, so loadgen/shares.py reads either."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvlab.experiments.loadgen.sampler import SAMPLE_EVERY_S, Ticker


class LedgerSampler:
    """`with LedgerSampler(pool, server_pids, t0) as s: ...` then `s.series`: one series per server, in order."""

    def __init__(self, pool: str, server_pids: list[int], t0: float, every_s: float = SAMPLE_EVERY_S) -> None:
        self.pool, self.server_pids, self.t0, self.every_s = pool, server_pids, t0, every_s
        self.series = [{"t": [], "pool_total_bytes": [], "pool_engine_bytes": []} for _ in server_pids]
        self.errors = 0
        self._ticker = Ticker(self._sample, every_s, "kvlab-ledger-sampler")

    def __enter__(self) -> LedgerSampler:
        self._ticker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ticker.stop()

    def _sample(self) -> None:
        from kvlab.vmm.pool import PoolError, status
        try:
            st = status(self.pool)
        except PoolError:
            self.errors += 1
            return
        held = {parent_pid(e.pid): e.held * st.page_size for e in st.engines}
        t = round(time.perf_counter() - self.t0, 4)
        for pid, series in zip(self.server_pids, self.series):
            series["t"].append(t)
            series["pool_total_bytes"].append(st.total * st.page_size)
            series["pool_engine_bytes"].append(held.get(pid, 0))


def parent_pid(pid: int) -> int | None:
    """The parent of a live process (None once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])
