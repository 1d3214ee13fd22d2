"""Per vmm page size: the contiguous kernel's advantage at which it overtakes the best paged block size, and the
driver latency at which it loses again. Both are `kvlab simulate serve`'s SLO search (slo.search: bracket, then
bisect geometrically) over a scale factor instead of a rate, judging "does paged still lead?" and "does vmm
still lead?" by the mean SLO rate over the paired seeds."""
from __future__ import annotations

import math
from typing import Any

from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.studies.page_size.probe import CellProbe

ADVANTAGE_START, ADVANTAGE_LOW, ADVANTAGE_LIMIT, ADVANTAGE_TOL = 0.25, 0.01, 16.0, 0.1
SCALE_START, SCALE_LIMIT, SCALE_TOL = 2.0, 4096.0, 0.25
LEAD = {"lead": 0.0}            # passes while the side being worn down still leads (or ties)


def bracket(found: slo.SearchResult) -> list[float]:
    """[last value where the leader held, first value where it lost] (inf: held up to the search's limit)."""
    lost = [x for x, ok in found.evaluations if not ok and x > found.rate]
    return [found.rate, min(lost, default=math.inf)]


def break_even_advantage(probe: CellProbe, case: SimCase) -> list[float]:
    """The bracket of advantages where paged stops leading vmm `case`; [0, 0] when vmm leads at today's costs."""
    target = probe.vmm(case, 1.0)
    if target > probe.best_paged(0.0):
        return [0.0, 0.0]
    found = slo.search(lambda a: {"failed": 0, "lead": target - probe.best_paged(a)}, LEAD, ADVANTAGE_START,
                       ADVANTAGE_TOL, low_limit=ADVANTAGE_LOW, high_limit=ADVANTAGE_LIMIT)
    return bracket(found)


def driver_flip(probe: CellProbe, case: SimCase, advantage: float) -> list[float]:
    """The bracket of driver-latency factors where vmm `case` stops leading paged at `advantage` (where it
    leads at today's driver latency)."""
    target = probe.best_paged(advantage)
    found = slo.search(lambda s: {"failed": 0, "lead": target - probe.vmm(case, s)}, LEAD, SCALE_START, SCALE_TOL,
                       low_limit=1.0, high_limit=SCALE_LIMIT)
    return bracket(found)


def flips(probe: CellProbe, case: SimCase, has_driver_costs: bool) -> dict[str, Any]:
    """Both searches for one vmm unit. The driver search runs where vmm leads: at today's costs, else at the
    upper end of the advantage bracket; none when the profile charges no driver calls or vmm never leads."""
    advantage = break_even_advantage(probe, case)
    at = advantage[1]
    scale = driver_flip(probe, case, at) if has_driver_costs and math.isfinite(at) else None
    return {"break_even_advantage": advantage, "driver_flip_at_advantage": at if scale else None,
            "driver_flip_scale": scale}
