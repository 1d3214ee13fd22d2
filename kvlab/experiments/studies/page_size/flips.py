"""Per vmm page size, around the profiles' own figures: the contiguous kernel's advantage at which the lead
changes hands with the best paged block size (at the profile's driver latency), and the driver latency at which
it does (at the profile's kernels): where vmm leads, the latency at which it loses again. Both are `kvlab
simulate serve`'s SLO search (slo.search: bracket, then bisect geometrically) over a scale factor instead of a
rate (on the kernel term's paged slowdown; on the driver profile's vmm calls), judging "does paged still lead?"
and "does vmm still lead?" by the mean SLO rate over the paired seeds."""
from __future__ import annotations

import math
from typing import Any

from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.studies.page_size.probe import CellProbe

KERNEL_START, KERNEL_LOW, KERNEL_LIMIT, KERNEL_TOL = 1.0, 0.01, 64.0, 0.1
SCALE_START, SCALE_LOW, SCALE_LIMIT, SCALE_TOL = 1.0, 1 / 1024, 4096.0, 0.25
LEAD = {"lead": 0.0}            # passes while the side being worn down still leads (or ties)


def bracket(found: slo.SearchResult) -> list[float]:
    """[last value where the leader held, first value where it lost] (inf: held up to the search's limit)."""
    lost = [x for x, ok in found.evaluations if not ok and x > found.rate]
    return [found.rate, min(lost, default=math.inf)]


def break_even_kernel(probe: CellProbe, case: SimCase) -> list[float]:
    """The bracket of kernel scales where paged stops leading vmm `case` ([0, 0.01]: vmm leads at every one)."""
    target = probe.vmm(case, 1.0)
    found = slo.search(lambda k: {"failed": 0, "lead": target - probe.best_paged(k)}, LEAD, KERNEL_START,
                       KERNEL_TOL, low_limit=KERNEL_LOW, high_limit=KERNEL_LIMIT)
    return bracket(found)


def driver_flip(probe: CellProbe, case: SimCase) -> list[float]:
    """The bracket of driver-latency factors where vmm `case` stops leading paged at the profile's kernel costs
    ([0, 1/1024]: it trails even with driver calls 1,024x faster)."""
    target = probe.best_paged(probe.today_scale)
    found = slo.search(lambda s: {"failed": 0, "lead": target - probe.vmm(case, s)}, LEAD, SCALE_START, SCALE_TOL,
                       low_limit=SCALE_LOW, high_limit=SCALE_LIMIT)
    return bracket(found)


def flips(probe: CellProbe, case: SimCase, has_driver_costs: bool) -> dict[str, Any]:
    """Both searches for one vmm unit (no driver search when the profile charges no driver calls)."""
    today = probe.today_scale
    kernel = break_even_kernel(probe, case)
    return {"kernel_scale_today": today, "decode_slowdown_today": probe.decode_slowdown(today),
            "leads_today": probe.vmm(case, 1.0) > probe.best_paged(today), "break_even_kernel_scale": kernel,
            "break_even_decode_slowdown": [probe.decode_slowdown(k) for k in kernel],
            "driver_flip_scale": driver_flip(probe, case) if has_driver_costs else None}
