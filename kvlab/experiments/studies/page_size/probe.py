"""Searches as the study asks for them: each (cell, unit, seed, costs) searched once, looked up in the journal
first (a resumed study reruns nothing it has), the rest run on the executor. A search away from the profile's
own costs starts at that unit's and seed's answer there, with narrow brackets (`kvlab simulate serve`'s warm
start). CellProbe gives the driver-flip search (flips.py) a cell's mean SLO rates under turned costs."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.kernels import kernel_profile
from kvlab.experiments.sim.serve.slo import warm_step
from kvlab.experiments.studies.page_size.executor import Executor
from kvlab.experiments.studies.page_size.journal import Journal, search_key
from kvlab.experiments.studies.page_size.point import Costs, SearchJob, search
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings, unit_label

TODAY = Costs()


def job(s: StudySettings, cell: Cell, case: SimCase, seed: int, costs: Costs, start: float = 0.0) -> SearchJob:
    """A search from `start` (near the answer: narrow brackets), or from --slo-start when none is known."""
    warm = start > 0
    return SearchJob(cell, cell.spec(s.spec), kernel_profile(cell.kernel), case, seed, costs, s.slo,
                     start if warm else s.slo_start, s.slo_tolerance,
                     warm_step(s.slo_tolerance) if warm else None)


def job_key(j: SearchJob) -> str:
    return search_key(j.cell.label, unit_label(j.case), j.seed, j.costs.kernel_scale, j.costs.driver_scale)


class Runner:
    """Runs searches once: what the journal holds is reused, the rest goes to the executor and into the journal."""

    def __init__(self, executor: Executor, journal: Journal) -> None:
        self.executor, self.journal = executor, journal

    def run(self, jobs: list[SearchJob]) -> list[dict[str, Any]]:
        todo = [j for j in jobs if job_key(j) not in self.journal.done]
        self.executor.map(search, todo, self.journal.add)
        return [self.journal.done[job_key(j)] for j in jobs]

    def today(self, cell: Cell, case: SimCase, seed: int) -> float:
        return self.journal.done[search_key(cell.label, unit_label(case), seed, None, 1.0)]["slo_rate"]

    def warm(self, s: StudySettings, cell: Cell, case: SimCase, seed: int, costs: Costs) -> SearchJob:
        return job(s, cell, case, seed, costs, self.today(cell, case, seed))


class CellProbe:
    def __init__(self, s: StudySettings, cell: Cell, runner: Runner) -> None:
        self.s, self.cell, self.runner = s, cell, runner

    def mean_rates(self, cases: list[SimCase], costs: Costs) -> dict[str, float]:
        jobs = [self.runner.warm(self.s, self.cell, c, seed, costs) for c in cases for seed in self.s.seeds]
        found = self.runner.run(jobs)
        n = len(self.s.seeds)
        return {unit_label(c): sum(r["slo_rate"] for r in found[i * n:(i + 1) * n]) / n for i, c in enumerate(cases)}

    def best_paged(self) -> float:
        """Paged's best mean rate at the profile's own costs."""
        return max(self.mean_rates([c for c in self.s.cases() if c.policy == "paged"], TODAY).values())

    def vmm(self, case: SimCase, driver_scale: float) -> float:
        """A vmm unit's mean rate with its driver calls scaled."""
        costs = TODAY if driver_scale == 1.0 else Costs(driver_scale=driver_scale)
        return self.mean_rates([case], costs)[unit_label(case)]
