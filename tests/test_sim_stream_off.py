"""The simulator's engine builds no per-request token deltas (Engine(stream_tokens=False)): nothing reads them, and
they were per token per sequence work. These tests run the same simulations with streaming forced back on and
check that every simulated figure is unchanged (host timings excluded), and that the switch really is off."""
from __future__ import annotations

import json
import math

import pytest

from kvlab.common import engine as engine_module
from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.core import HOST_TIMED, SimCase
from kvlab.experiments.sim.serve.run import ServeSpec, run_point

HOST_KEYS = set(HOST_TIMED) | {"host_seconds"}


class StreamingEngine(engine_module.Engine):
    """The engine as the simulator built it before: token deltas built every step."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["stream_tokens"] = True
        super().__init__(*args, **kwargs)


class CountingEngine(engine_module.Engine):
    """Records how many token deltas each step returned."""
    deltas = 0
    steps = 0

    def step(self):
        result = super().step()
        CountingEngine.steps += 1
        CountingEngine.deltas += len(result.new_tokens)
        return result


def strip(value):
    """`value` without host-timed figures, at any depth."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in HOST_KEYS}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def seed_rows(tmp_path, name: str) -> list[dict]:
    path = tmp_path / f"{name}.json"
    assert main(["simulate", "--preset", "seed", "--num-requests", "40", "--jobs", "1", "--no-progress",
                 "--json", str(path)]) == 0
    return strip(json.loads(path.read_text())["rows"])


def test_seed_preset_rows_are_the_same_with_streaming_on(tmp_path, monkeypatch):
    off = seed_rows(tmp_path, "off")
    monkeypatch.setattr(engine_module, "Engine", StreamingEngine)
    on = seed_rows(tmp_path, "on")
    assert len(off) > 10 and off == on


SERVE_CASES = [SimCase("paged", 6.0, 16, watermark=0.05), SimCase("vmm", 6.0, page_size=2 * 2**20, watermark=0.05),
               SimCase("reserve", 2.0)]


@pytest.mark.parametrize("case", SERVE_CASES, ids=lambda c: c.label)
def test_simulate_serve_results_are_the_same_with_streaming_on(case, monkeypatch):
    spec = ServeSpec(num_requests=120, driver_profile="cuda-a100")
    off = strip(run_point(case, spec, 30.0, 0))
    monkeypatch.setattr(engine_module, "Engine", StreamingEngine)
    on = strip(run_point(case, spec, 30.0, 0))
    assert off["completed"] == 120 and off == on


def test_the_simulators_engine_returns_no_token_deltas(monkeypatch):
    monkeypatch.setattr(engine_module, "Engine", CountingEngine)
    CountingEngine.deltas = CountingEngine.steps = 0
    result = run_point(SimCase("paged", 6.0, 16), ServeSpec(num_requests=20), math.inf, 0)
    assert result["completed"] == 20 and CountingEngine.steps > 20 and CountingEngine.deltas == 0
    monkeypatch.setattr(engine_module, "Engine", type("Both", (StreamingEngine, CountingEngine), {}))
    CountingEngine.deltas = CountingEngine.steps = 0
    run_point(SimCase("paged", 6.0, 16), ServeSpec(num_requests=20), math.inf, 0)
    assert CountingEngine.deltas > 20          # the counter sees deltas when they are built
