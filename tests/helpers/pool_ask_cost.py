"""What a starved engine waits for beside a busy one (docs/pool.md, the elastic protocol's step 2).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python tests/helpers/pool_ask_cost.py RUNS

A busy engine (helpers/pool_engines.py's BusyEngine) holds the whole pool and gives exactly what is asked, from its
steward thread; an engine runs the longest test prompt beside it. Printed per run: the engine's asks (each one a
wait for a steward round), the run's seconds, its map+unmap seconds (taking pool pages, waits included) and its
preemptions. Not a test: a measurement.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from helpers.pool_engines import starved_run  # noqa: E402


def one_run() -> str:
    run = starved_run()
    return (f"{run.asks} asks, run {run.seconds:.2f} s, map+unmap {run.map_unmap_s:.2f} s, "
            f"{run.preemptions} preemptions")


if __name__ == "__main__":
    for _ in range(int(sys.argv[1])):
        print(one_run(), flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")
