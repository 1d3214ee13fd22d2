"""A cell's mean SLO rates under turned costs: each (unit, costs) searched once over every seed, on the executor.
The searches at the profile's own costs come from the study's grid; a later search of the same unit and seed
starts at that answer with narrow brackets (`kvlab simulate serve`'s warm start)."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.kernels import KernelProfile, kernel_profile
from kvlab.experiments.sim.serve.cli import WARM_STEP
from kvlab.experiments.studies.page_size.executor import Executor
from kvlab.experiments.studies.page_size.point import FLAT, Costs, SearchJob, search
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings, unit_label

TODAY = Costs()


def job(s: StudySettings, cell: Cell, case: SimCase, seed: int, costs: Costs, start: float = 0.0) -> SearchJob:
    """A search from `start` (near the answer: narrow brackets), or from --slo-start when none is known."""
    warm = start > 0
    return SearchJob(cell, cell.spec(s.spec), kernel_profile(cell.kernel), case, seed, costs, s.slo,
                     start if warm else s.slo_start, s.slo_tolerance, WARM_STEP if warm else 2.0)


class CellProbe:
    def __init__(self, s: StudySettings, cell: Cell, executor: Executor, grid: list[dict[str, Any]]) -> None:
        self.s, self.cell, self.executor = s, cell, executor
        self.searches = [r for r in grid if r["cell"] == cell.label]
        self.found = {(r["unit"], TODAY, r["seed"]): r["slo_rate"] for r in self.searches}
        base = kernel_profile(cell.kernel)
        self.shape: KernelProfile = base or FLAT       # what the kernel scale multiplies
        self.today_scale = 1.0 if base else 0.0        # `none`: no slowdown

    def mean_rates(self, cases: list[SimCase], costs: Costs) -> dict[str, float]:
        todo = [(c, seed) for c in cases for seed in self.s.seeds if (unit_label(c), costs, seed) not in self.found]
        jobs = [job(self.s, self.cell, c, seed, costs, self.found[(unit_label(c), TODAY, seed)]) for c, seed in todo]
        for r in self.executor.map(search, jobs):
            self.searches.append(r)
            self.found[(r["unit"], costs, r["seed"])] = r["slo_rate"]
        seeds = self.s.seeds
        return {unit_label(c): sum(self.found[(unit_label(c), costs, k)] for k in seeds) / len(seeds) for c in cases}

    def best_paged(self, kernel_scale: float) -> float:
        """Paged's best mean rate with the kernel term's slowdown scaled (paged pays no vmm driver calls)."""
        paged = [c for c in self.s.cases() if c.policy == "paged"]
        costs = TODAY if kernel_scale == self.today_scale else Costs(kernel_scale=kernel_scale)
        return max(self.mean_rates(paged, costs).values())

    def decode_slowdown(self, kernel_scale: float) -> float:
        """Paged decode time / contiguous at a scale: 16-token blocks, 4,096-token contexts."""
        return 1 + kernel_scale * (self.shape.ratio("decode", 16, 4096) - 1)

    def vmm(self, case: SimCase, driver_scale: float) -> float:
        """A vmm unit's mean rate with its driver calls scaled (contiguous kernels: the kernel scale is moot)."""
        return self.mean_rates([case], Costs(driver_scale=driver_scale))[unit_label(case)]
