"""The study: every cell's grid of SLO searches at the profiles' own costs, then the kernel-ratio curve (the
paged units re-searched at each ratio), then (optionally) each vmm unit's driver flip. Every search goes through
the journal; the result is a function of the searches done (`assemble`), so an interrupted study reports what
it has."""
from __future__ import annotations

import time
from typing import Any

from kvlab.experiments.sim.kernels import kernel_profile
from kvlab.experiments.sim.serve.costs import profile
from kvlab.experiments.studies.page_size import curve
from kvlab.experiments.studies.page_size.executor import Executor
from kvlab.experiments.studies.page_size.flips import flips
from kvlab.experiments.studies.page_size.journal import Journal
from kvlab.experiments.studies.page_size.point import Costs, curve_shape
from kvlab.experiments.studies.page_size.probe import TODAY, CellProbe, Runner, job
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings, unit_label
from kvlab.experiments.studies.page_size.summary import cell_summary, curve_summary
from kvlab.experiments.studies.page_size.verdict import verdict


def curve_scales(s: StudySettings, cell: Cell) -> dict[float, float]:
    """kernel ratio r -> the factor on the cell's curve shape that gives paged-16 decode r (point.py)."""
    shape = curve_shape(kernel_profile(cell.kernel))
    return {r: curve.scale_for(shape, r) for r in s.kernel_ratios}


def profile_ratio(cell: Cell) -> float | None:
    """The cell's own r (paged-16 decode over contiguous at 4,096 tokens); None for `none`."""
    base = kernel_profile(cell.kernel)
    return None if base is None else curve.reference_ratio(base)


def grid_jobs(s: StudySettings) -> list[Any]:
    return [job(s, cell, case, seed, TODAY) for cell in s.cells for case in s.cases() for seed in s.seeds]


def curve_jobs(s: StudySettings, runner: Runner) -> list[Any]:
    paged = [c for c in s.cases() if c.policy == "paged"]
    return [runner.warm(s, cell, case, seed, Costs(kernel_scale=k)) for cell in s.cells
            for k in curve_scales(s, cell).values() for case in paged for seed in s.seeds]


def has_driver_costs(s: StudySettings, cell: Cell) -> bool:
    p = profile(cell.driver, s.spec.calibration, s.vmm_pages[0]) if s.vmm_pages else None
    return p is not None and any((p.map_s, p.set_access_s, p.unmap_s))


def driver_flips(s: StudySettings, runner: Runner) -> dict[str, dict[str, Any]]:
    out = {}
    for cell in s.cells:
        if has_driver_costs(s, cell):
            probe = CellProbe(s, cell, runner)
            out[cell.label] = {unit_label(c): flips(probe, c) for c in s.cases() if c.policy == "vmm"}
    return out


def assemble(s: StudySettings, searches: list[dict[str, Any]], flipped: dict[str, Any] | None = None
             ) -> dict[str, dict[str, Any]]:
    """Each cell's summary and curve from the searches done (the complete ones only), with its searches."""
    units = [unit_label(c) for c in s.cases()]
    paged, vmm = [u for u in units if u.startswith("paged-")], [u for u in units if u.startswith("vmm-")]
    cells = {}
    for cell in s.cells:
        mine = [r for r in searches if r["cell"] == cell.label]
        today = [r for r in mine if r["kernel_scale"] is None and r["driver_scale"] == 1.0]
        summary = cell_summary(today, units, len(s.seeds))
        if summary is None:
            continue
        summary["kernel_ratio_today"] = profile_ratio(cell)
        summary["curve"] = curve_summary(mine, today, curve_scales(s, cell), paged, vmm, len(s.seeds))
        summary["driver_flips"] = (flipped or {}).get(cell.label)
        summary["searches"] = mine
        cells[cell.label] = summary
    return cells


def brief(cells: dict[str, Any]) -> dict[str, Any]:
    return {label: {k: v for k, v in c.items() if k != "searches"} for label, c in cells.items()}


def run_study(s: StudySettings, journal: Journal | None = None) -> dict[str, Any]:
    """{"cells": label -> summary, curve, flips and every search, "verdict": the paragraph, "host_seconds"}."""
    t0 = time.perf_counter()
    runner = Runner(Executor(s.jobs, s.ray, s.progress), journal or Journal())
    runner.run(grid_jobs(s))
    flipped = None
    if s.flips:
        runner.run(curve_jobs(s, runner))
        flipped = driver_flips(s, runner) if s.driver_flips else None
    cells = assemble(s, runner.journal.searches, flipped)
    return {"cells": cells, "verdict": verdict(brief(cells)),
            "host_seconds": time.perf_counter() - t0}
