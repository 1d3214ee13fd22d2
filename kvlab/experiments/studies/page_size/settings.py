"""What a page-size study was asked for: the cells (one per driver profile, kernel profile, TP degree and
prefix-caching setting: a line in the plot) and the units compared in each."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvlab.experiments.sim.core import SimCase, format_page
from kvlab.experiments.sim.layouts import CROSS_LAYER, LAYOUT_OPTION
from kvlab.experiments.sim.serve.run import ServeSpec


@dataclass(frozen=True, slots=True)
class Cell:
    """One profile: everything but the unit and the seed."""
    driver: str
    kernel: str
    tp: int = 1
    prefix_caching: bool = False

    @property
    def label(self) -> str:
        extra = (f", tp {self.tp}" if self.tp > 1 else "") + (", prefix caching" if self.prefix_caching else "")
        return f"driver {self.driver}, kernel {self.kernel}{extra}"

    def spec(self, base: ServeSpec) -> ServeSpec:
        engine = {**base.engine, "enable_prefix_caching": True} if self.prefix_caching else dict(base.engine)
        return replace(base, driver_profile=self.driver, kernel_costs=self.kernel, tensor_parallel_size=self.tp,
                       engine=engine)


@dataclass(frozen=True, slots=True)
class StudySettings:
    spec: ServeSpec                       # the workload, model and hardware; each cell sets its own profiles
    slo: dict[str, float]
    seeds: tuple[int, ...]
    cells: tuple[Cell, ...]
    paged_blocks: tuple[int, ...] = (16, 32, 128)
    vmm_pages: tuple[int, ...] = (64 * 1024, 256 * 1024, 2 * 1024 ** 2)
    vmm_layouts: tuple[str, ...] = ("per-layer",)   # each vmm page size runs in each (experiments/sim/layouts.py)
    elastic_blocks: tuple[int, ...] = ()  # the optional elastic arm: these block sizes over each vmm page size
    budget_gb: float = 60.0
    watermark: float = 0.05
    slo_start: float = 4.0
    slo_tolerance: float = 0.02
    flips: bool = True                    # the kernel-ratio curve
    kernel_ratios: tuple[float, ...] = (1.0, 1.5, 2.0)
    driver_flips: bool = False            # the driver-latency flip search (slow: sequential bisections)
    jobs: int = 2
    ray: str | None = None                # a Ray cluster's address; None: the local process pool
    progress: bool = True
    out: str | None = None
    save: bool = True
    plots: bool = True

    def cases(self) -> list[SimCase]:
        paged = [SimCase("paged", self.budget_gb, block_size=b, watermark=self.watermark) for b in self.paged_blocks]
        vmm = [SimCase("vmm", self.budget_gb, page_size=p, watermark=self.watermark,
                       **({LAYOUT_OPTION: CROSS_LAYER} if layout == CROSS_LAYER else {}))
               for p in self.vmm_pages for layout in self.vmm_layouts]
        elastic = [SimCase("elastic", self.budget_gb, watermark=self.watermark, elastic_block_size=b,
                           elastic_page_size=p) for b in self.elastic_blocks for p in self.vmm_pages]
        return paged + vmm + elastic


def unit_label(case: SimCase) -> str:
    """paged-16, vmm-2MiB, vmm-2MiB-crosslayer, elastic-16-2MiB: the study's name for a backend and its unit."""
    if case.policy == "elastic":
        return f"elastic-{case.options['elastic_block_size']}-{format_page(case.options['elastic_page_size'])}"
    if case.policy == "vmm":
        layout = "-crosslayer" if case.layout == CROSS_LAYER else ""
        return f"vmm-{format_page(case.options['page_size'])}{layout}"
    return f"paged-{case.options['block_size']}"
