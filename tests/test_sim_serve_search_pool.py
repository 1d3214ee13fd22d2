"""Searches run point by point over the workers (sim/serve/search_pool.py): each search tries exactly the points
it tries alone, follow-up searches start from a finished one's answer, and a checkpointed search is not run."""
from __future__ import annotations

import pytest

from kvlab.experiments.reporting.checkpoint import Checkpoint
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.grid import Saved
from kvlab.experiments.sim.serve.search_pool import Search, run_searches

TARGET = slo.parse_slo("p99_ttft_ms<=2000")
KNEES = (23.7, 11.0, 5.3)


def service(args: tuple[float, float]) -> dict:
    knee, rate = args
    if knee < 0:
        raise ValueError("bad knee")
    return {"failed": 0, "p99_ttft_ms": 100.0 if rate <= knee else 1e4}


def search(knee: float, start: float, step: float = 2.0) -> Search:
    return Search(("knee", knee, start), slo.search_steps(TARGET, start, 0.02, step=step), lambda rate: (knee, rate),
                  lambda found: {"knee": knee, "start": start, "rate": found.rate,
                                 "evaluations": found.evaluations})


def alone(knee: float, start: float, step: float = 2.0) -> dict:
    found = slo.search(lambda rate: service((knee, rate)), TARGET, start, 0.02, step=step)
    return {"knee": knee, "start": start, "rate": found.rate, "evaluations": found.evaluations}


def warm(found: dict) -> list[Search]:
    """A follow-up search per first search, near its answer (a knee 10% higher)."""
    return [search(found["knee"] * 1.1, found["rate"], 1.05)] if found["start"] == 4.0 else []


@pytest.mark.parametrize("jobs", [1, 2])
def test_interleaved_searches_try_the_points_each_tries_alone(jobs):
    first = [search(k, 4.0) for k in KNEES]
    first[0].gating = True
    got = run_searches(service, first, warm, 2 * len(KNEES), jobs)
    expected = [alone(k, 4.0) for k in KNEES]
    expected += [alone(e["knee"] * 1.1, e["rate"], 1.05) for e in expected]
    key = lambda f: (f["knee"], f["start"])                          # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key)


def test_a_checkpointed_search_is_taken_not_run_and_its_follow_ups_still_start(tmp_path):
    cp = Checkpoint(tmp_path, ["simulate"], {}, total=2, resume=False)
    kept = {**alone(23.7, 4.0), "rate": 20.0}          # what the checkpoint says, not what a run would find
    cp.record("search 23.7", kept)
    got = run_searches(service, [search(23.7, 4.0)], warm, 2, 1, saved=Saved(cp, lambda job: f"search {job[1]}"))
    assert got[0] == kept and got[1]["start"] == 20.0 and got[1] == alone(23.7 * 1.1, 20.0, 1.05)
    assert f"search {23.7 * 1.1}" in cp


def test_a_workers_error_is_raised():
    with pytest.raises(ValueError, match="bad knee"):
        run_searches(service, [search(23.7, 4.0), search(-1.0, 4.0)], warm, 2, 2)
