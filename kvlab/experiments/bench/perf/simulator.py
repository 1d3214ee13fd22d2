"""The simulator's own speed: host seconds for one 2,000-request seed simulation (`kvlab simulate --preset
seed` runs 15 of them), and the scheduler's overhead per scheduled sequence per step.

Each case is experiments.simulation.run_case (the real scheduler, accounting-only caches, roofline clock) on the
seed article's workload. Scheduler overhead is Engine's wall time in schedule() + update()
(RunMetrics.scheduler_seconds) over the sequence-steps it scheduled (mean batch x steps).
"""
from __future__ import annotations

from kvlab.experiments.bench.perf.harness import Goal, Result, Settings, Timing, timing_detail

FAMILY = "simulator"
GOAL = Goal("<=", 3.0)
MAX_REPEATS = 3


def cases():
    from kvlab.experiments.sim.core import SimCase
    return [SimCase("paged", 60.0, 16, watermark=0.05), SimCase("vmm", 60.0, page_size=2 * 2**20, watermark=0.05),
            SimCase("reserve", 60.0)]


def simulate(case, settings, requests) -> tuple[float, float, int]:
    """One case through experiments.simulation.run_case -> (host seconds, scheduler seconds, sequence-steps).
    The simulator has no token budget, so every running sequence is scheduled every step."""
    from kvlab.experiments.sim.core import run_case
    row = run_case(case, settings, requests)
    return row.wall_seconds, row.scheduler_seconds, round(row.mean_batch * row.steps)


def run(settings: Settings) -> list[Result]:
    from kvlab.experiments.sim.core import SimSettings
    from kvlab.experiments.workloads.requests import WorkloadSpec, build_workload
    n = 100 if settings.quick else 2000
    sim = SimSettings(workload=WorkloadSpec(kind="seed", num_requests=n, seed=settings.seed))
    requests = build_workload(sim.workload)
    rows = []
    for case in cases():
        runs = [simulate(case, sim, requests) for _ in range(min(settings.repeats, MAX_REPEATS))]
        wall = Timing.of([r[0] for r in runs])
        per_item = Timing.of([r[1] / max(r[2], 1) for r in runs])
        rows.append(Result(FAMILY, f"{n}-request seed simulation, {case.label}", wall.median, "s", GOAL,
                           note=f"{runs[0][2]:,} scheduled sequence-steps",
                           detail={**timing_detail(wall), "per_repeat": wall.samples}))
        rows.append(Result(FAMILY, f"scheduler overhead per sequence per step, {case.label}",
                           per_item.median * 1e6, "us", note="schedule() + update() wall time / batch items",
                           detail=timing_detail(per_item)))
    return rows
