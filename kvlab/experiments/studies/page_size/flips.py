"""Per vmm page size, at the profile's own kernel costs: the driver latency (a factor on the profile's vmm calls)
at which the lead over the best paged block size changes hands; where vmm leads, the latency at which it loses
again. `kvlab simulate serve`'s SLO search (slo.search: bracket, then bisect geometrically) over the factor
instead of a rate, judging "does vmm still lead?" by the mean SLO rate over the paired seeds: a bracket on the
mean, without an interval (docs/study.md). The kernel's break-even is the curve's (curve.py)."""
from __future__ import annotations

import math
from typing import Any

from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.studies.page_size.probe import CellProbe

SCALE_START, SCALE_LOW, SCALE_LIMIT, SCALE_TOL = 1.0, 1 / 1024, 4096.0, 0.25
LEAD = {"lead": 0.0}            # passes while the side being worn down still leads (or ties)


def bracket(found: slo.SearchResult) -> list[float]:
    """[last value where the leader held, first value where it lost] (inf: held up to the search's limit)."""
    lost = [x for x, ok in found.evaluations if not ok and x > found.rate]
    return [found.rate, min(lost, default=math.inf)]


def driver_flip(probe: CellProbe, case: SimCase) -> list[float]:
    """The bracket of driver-latency factors where vmm `case` stops leading paged at the profile's kernel costs
    ([0, 1/1024]: it trails even with driver calls 1,024x faster)."""
    target = probe.best_paged()
    found = slo.search(lambda s: {"failed": 0, "lead": target - probe.vmm(case, s)}, LEAD, SCALE_START, SCALE_TOL,
                       low_limit=SCALE_LOW, high_limit=SCALE_LIMIT, step=2.0)     # powers of two to the limits
    return bracket(found)


def flips(probe: CellProbe, case: SimCase) -> dict[str, Any]:
    return {"leads_today": probe.vmm(case, 1.0) > probe.best_paged(), "driver_flip_scale": driver_flip(probe, case)}
