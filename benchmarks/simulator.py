"""The simulator's own speed: host seconds for one 2,000-request seed simulation (`kvlab simulate --preset
seed` runs 15 of them), and the scheduler's overhead per scheduled sequence per step.

Each case is experiments.simulate.run_case (the real scheduler, accounting-only caches, roofline clock) on the
seed article's workload. Scheduler overhead is Engine's wall time in schedule() + update()
(RunMetrics.scheduler_seconds) over the batch items it scheduled, counted by a runner wrapper.
"""
from __future__ import annotations

import time

from benchmarks.harness import Goal, Result, Settings, Timing, timing_detail

FAMILY = "simulator"
GOAL = Goal("<=", 3.0)
MAX_REPEATS = 3


def cases():
    from experiments.simulate import SimCase
    return [SimCase("paged", 60.0, 16, watermark=0.05), SimCase("vmm", 60.0, page_size=2 * 2**20, watermark=0.05),
            SimCase("reserve", 60.0)]


class CountingRunner:
    """Wraps the roofline runner; counts the batch items (scheduled sequences) of every step."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.items = 0

    def clock(self) -> float:
        return self.runner.clock()

    def execute(self, out):
        self.items += len(out.items)
        return self.runner.execute(out)


def simulate(case, settings, requests) -> tuple[float, float, int]:
    """One case exactly as experiments.simulate.run_case runs it, plus an item counter
    -> (host seconds, scheduler seconds, scheduled items)."""
    from common.engine import Engine
    from common.kv_cache import create_cache
    from experiments.roofline import RooflineCost, RooflineRunner, hardware, model_spec
    from experiments.simulate import SAMPLED_TOKEN, WasteProbe, case_config, drive
    spec = model_spec(settings.model, settings.dtype)
    cost = RooflineCost(hardware(settings.hardware), spec, settings.model_prefill, settings.mfu)
    config = case_config(case, settings, requests)
    start = time.perf_counter()
    cache = create_cache(config, spec.kv_shape(), accounting_only=True)
    roofline = RooflineRunner(cost, SAMPLED_TOKEN)
    counter = CountingRunner(WasteProbe(roofline, cache, config.max_model_len))
    engine = Engine(config, cache, counter, timeline_every=10**9)
    try:
        engine.reset_metrics()
        drive(engine, roofline, requests)
        metrics = engine.metrics()
    finally:
        engine.close()
    return time.perf_counter() - start, metrics.scheduler_seconds, counter.items


def run(settings: Settings) -> list[Result]:
    from experiments.simulate import SimSettings
    from experiments.workload import WorkloadSpec, build_workload
    n = 100 if settings.quick else 2000
    sim = SimSettings(workload=WorkloadSpec(kind="seed", num_requests=n, seed=settings.seed))
    requests = build_workload(sim.workload)
    rows = []
    for case in cases():
        runs = [simulate(case, sim, requests) for _ in range(min(settings.repeats, MAX_REPEATS))]
        wall = Timing.of([r[0] for r in runs])
        per_item = Timing.of([r[1] / max(r[2], 1) for r in runs])
        rows.append(Result(FAMILY, f"{n}-request seed simulation, {case.label}", wall.median, "s", GOAL,
                           note=f"{runs[0][2]:,} scheduled sequence-steps", detail=timing_detail(wall)))
        rows.append(Result(FAMILY, f"scheduler overhead per sequence per step, {case.label}",
                           per_item.median * 1e6, "us", note="schedule() + update() wall time / batch items",
                           detail=timing_detail(per_item)))
    return rows
