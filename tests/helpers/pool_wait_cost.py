"""What a starved engine waits for an idle engine's give-back (docs/pool.md, the elastic protocol's step 2).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python tests/helpers/pool_wait_cost.py RUNS

Engine A (a child process) runs the test prompts and idles holding its freed slots' pages; engine B (this process)
runs the same prompts on what is left of the pool: every refused take asks the others, and the time from the ask to
the granted take is recorded (PooledMemory._ask wrapped). Not a test: a measurement, printed.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from helpers.pool_engines import BASE, LONGEST, PAGE, PARAMS, PROMPTS, read_line, start_engine  # noqa: E402
from kvlab import LLM  # noqa: E402
from kvlab.vmm import pool  # noqa: E402
from kvlab.vmm.drivers import pooled  # noqa: E402


def timed_asks(waits: list[float]) -> None:
    ask = pooled.PooledMemory._ask

    def timed(self: pooled.PooledMemory, need: int) -> list[int]:
        t0 = time.perf_counter()
        try:
            return ask(self, need)
        finally:
            waits.append(time.perf_counter() - t0)
    pooled.PooledMemory._ask = timed


def one_run() -> None:
    with pool.create(f"wait-{uuid.uuid4().hex[:8]}", LONGEST + 32 * PAGE, page_size=PAGE) as holder:
        a = start_engine(holder.name)
        read_line(a)
        llm = LLM(**BASE, kv_pool=holder.name)
        llm.generate(PROMPTS, PARAMS)
        llm.close()
        a.stdin.write("\n")
        a.stdin.flush()
        read_line(a)
        a.wait()


def main(runs: int) -> None:
    waits: list[float] = []
    timed_asks(waits)
    for _ in range(runs):
        one_run()
    ms = sorted(w * 1000 for w in waits)
    print(f"{len(ms)} waits: median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms, "
          f"{sum(ms) / 1000 / runs:.2f} s waited a run; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
