"""The study: every cell's grid of SLO searches at the profiles' own costs, then each vmm unit's flips."""
from __future__ import annotations

import time
from typing import Any

from kvlab.experiments.sim.serve.costs import profile
from kvlab.experiments.studies.page_size.executor import Executor
from kvlab.experiments.studies.page_size.flips import flips
from kvlab.experiments.studies.page_size.point import search
from kvlab.experiments.studies.page_size.probe import TODAY, CellProbe, job
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings, unit_label
from kvlab.experiments.studies.page_size.summary import cell_summary
from kvlab.experiments.studies.page_size.verdict import verdict


def grid(s: StudySettings, executor: Executor) -> list[dict[str, Any]]:
    jobs = [job(s, cell, case, seed, TODAY) for cell in s.cells for case in s.cases() for seed in s.seeds]
    return executor.map(search, jobs)


def has_driver_costs(s: StudySettings, cell: Cell) -> bool:
    p = profile(cell.driver, s.spec.calibration, s.vmm_pages[0]) if s.vmm_pages else None
    return p is not None and any((p.map_s, p.set_access_s, p.unmap_s))


def study_cell(s: StudySettings, cell: Cell, executor: Executor, found: list[dict[str, Any]]) -> dict[str, Any]:
    probe = CellProbe(s, cell, executor, found)
    out = cell_summary(probe.searches, [unit_label(c) for c in s.cases()])
    if s.flips:
        driver = has_driver_costs(s, cell)
        out["flips"] = {unit_label(c): flips(probe, c, driver) for c in s.cases() if c.policy == "vmm"}
    out["searches"] = probe.searches
    return out


def run_study(s: StudySettings) -> dict[str, Any]:
    """{"cells": label -> summary, flips and every search, "verdict": the paragraph, "host_seconds"}."""
    t0 = time.perf_counter()
    executor = Executor(s.jobs, s.ray, s.progress)
    found = grid(s, executor)
    cells = {cell.label: study_cell(s, cell, executor, found) for cell in s.cells}
    brief = {label: {k: v for k, v in c.items() if k != "searches"} for label, c in cells.items()}
    return {"cells": cells, "verdict": verdict(brief), "host_seconds": time.perf_counter() - t0}
