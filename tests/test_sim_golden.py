"""The simulator's figures stay exactly what tests/golden/sim_rows.json recorded (written by
tests/golden/make_sim_rows.py before the simulator's speed work of issue 39): speeding the loop up must not move a
simulated number. Host timings are excluded; floats are compared as their repr."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import sim_golden_cases as cases

GOLDEN = json.loads((Path(__file__).parent / "golden" / "sim_rows.json").read_text())


def test_seed_preset_rows_are_unchanged(tmp_path):
    rows = cases.seed_rows(tmp_path)
    assert len(rows) > 10 and rows == GOLDEN["seed"]


@pytest.mark.parametrize("key", cases.SERVE_KEYS)
def test_simulate_serve_points_are_unchanged(key):
    row = cases.serve_point(key)
    assert row.get("stopped_early") if key == "stopped" else row["completed"] > 0
    assert row == GOLDEN["serve"][key]


@pytest.mark.slow
def test_a_small_slo_search_finds_the_same_rate_through_the_same_runs():
    found = cases.search()
    assert found["evaluations"] == GOLDEN["search"]["evaluations"]
    assert found == GOLDEN["search"]
