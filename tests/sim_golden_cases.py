"""The simulations whose rows tests/golden/sim_rows.json holds: the seed preset's table, simulate-serve points on
each backend (driver costs on, one stopped early by its SLO) and a small SLO search. Host timings excluded."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.core import HOST_TIMED, SimCase
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.run import ServeSpec, run_point

HOST_KEYS = set(HOST_TIMED) | {"host_seconds"}
SERVE_CASES = [SimCase("paged", 6.0, 16, watermark=0.05), SimCase("vmm", 6.0, page_size=2 * 2**20, watermark=0.05),
               SimCase("reserve", 2.0)]
SERVE_KEYS = [c.label for c in SERVE_CASES] + ["stopped", "unbounded"]
SLO = slo.parse_slo("p99_ttft_ms<=2000,p99_tpot_ms<=100")


def strip(value: Any) -> Any:
    """`value` without host-timed figures, at any depth; floats as their repr (exact, and NaN-safe)."""
    if isinstance(value, dict):
        return {str(k): strip(v) for k, v in value.items() if k not in HOST_KEYS}
    if isinstance(value, (list, tuple)):
        return [strip(v) for v in value]
    if isinstance(value, float):
        return repr(value)
    return value


def point(row: dict[str, Any]) -> dict[str, Any]:
    """A simulate-serve row, its per-request log (most of its size) as a digest of the stripped entries."""
    row = strip(row)
    if "requests" in row:
        log = json.dumps(row["requests"], sort_keys=True).encode()
        row["requests"] = {"count": len(row["requests"]), "sha256": hashlib.sha256(log).hexdigest()}
    return row


def seed_rows(tmp: Path) -> list:
    path = tmp / "seed.json"
    assert main(["simulate", "--preset", "seed", "--num-requests", "40", "--jobs", "1", "--no-progress",
                 "--json", str(path)]) == 0
    return strip(json.loads(path.read_text())["rows"])


def serve_point(key: str) -> dict[str, Any]:
    """One of SERVE_KEYS: each backend at 30 req/s with driver costs, a run its SLO stops early, one unbounded."""
    if key == "stopped":
        return point(run_point(SERVE_CASES[0], ServeSpec(num_requests=200), 400.0, 1, stop_on_miss=SLO))
    if key == "unbounded":
        return point(run_point(SERVE_CASES[1], ServeSpec(num_requests=60), math.inf, 2))
    case = next(c for c in SERVE_CASES if c.label == key)
    return point(run_point(case, ServeSpec(num_requests=120, driver_profile="cuda-a100"), 30.0, 0))


def serve_points() -> dict[str, Any]:
    return {key: serve_point(key) for key in SERVE_KEYS}


def search() -> dict[str, Any]:
    spec = ServeSpec(num_requests=100)
    # doubling from 4, as when the golden was written: the same points, so their rows must be the same (the default
    # bracket, slo.bracket_step, is tested in test_sim_serve_search_speed.py)
    found = slo.search(lambda rate: run_point(SERVE_CASES[1], spec, rate, 0, stop_on_miss=SLO), SLO, 4.0, 0.02,
                       step=2.0)
    return {"rate": repr(found.rate), "evaluations": strip(found.evaluations),
            "results": [point(found.results[r]) for r, _ in found.evaluations]}


def collect(tmp: Path) -> dict[str, Any]:
    return {"seed": seed_rows(tmp), "serve": serve_points(), "search": search()}
