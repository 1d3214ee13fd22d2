"""What a starved engine waits for beside a busy one (docs/pool.md, the elastic protocol's step 2).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python tests/pool_ask_cost.py RUNS

A busy engine (tests/test_pool_ask.py's BusyEngine) holds the whole pool and gives exactly what is asked, from its
steward thread; an engine runs the longest test prompt beside it. Printed per run: the engine's asks (each one a
wait for a steward round), the run's seconds, its map+unmap seconds (taking pool pages, waits included) and its
preemptions. Not a test: a measurement.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())

from kvlab import LLM  # noqa: E402
from kvlab.vmm import pool  # noqa: E402
from tests.test_pool_ask import BusyEngine  # noqa: E402
from tests.test_pool_engine import BASE, LONGEST, PAGE, PARAMS, PROMPTS, pool_name  # noqa: E402
from tests.test_pool_fixes import Asks  # noqa: E402


def one_run() -> str:
    with pool.create(pool_name(), LONGEST, page_size=PAGE, engine="busy") as member:
        BusyEngine(member)
        llm = LLM(**(BASE | {"kv_pool": member.name}))
        try:
            asks = Asks(llm.engine.cache.allocator.driver.member)
            t0 = time.perf_counter()
            llm.generate([PROMPTS[-1]], PARAMS)
            wall, stats = time.perf_counter() - t0, llm.cache_stats()
            return (f"{asks.count} asks, run {wall:.2f} s, map+unmap {stats.map_seconds + stats.unmap_seconds:.2f} s, "
                    f"{llm.metrics().preemptions} preemptions")
        finally:
            llm.close()


if __name__ == "__main__":
    for _ in range(int(sys.argv[1])):
        print(one_run(), flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")
