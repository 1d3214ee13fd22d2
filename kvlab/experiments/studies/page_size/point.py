"""One simulated serving run under the study's two turned unknowns, and one SLO search over such runs.

The contiguous kernel's advantage is the simulator's kernel term (experiments/sim/kernels.py) scaled: every
point of the cell's kernel profile, paged time / contiguous time = r, becomes 1 + kernel_scale x (r - 1) (FLAT,
a 2x slowdown at every phase, context and block size, stands in for a profile that charges paged-16 nothing). The scaled
profile reaches the simulator as `measured:FILE`, written where the search runs (a pool worker or a Ray node).
The driver's latency is the profile's map calls (cuMemMap, cuMemSetAccess, cuMemUnmap; vmm's and elastic's) times
`driver_scale`.
Requests and arrivals come from sim/serve/run.py's `plan` (identical for every backend: paired seeds); the
prefix workloads add token ids."""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvlab.experiments.loadgen import latency
from kvlab.experiments.sim.core import SimCase, run_case
from kvlab.experiments.sim.kernels import KernelProfile, Point
from kvlab.experiments.sim.roofline import model_spec
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.costs import CostLedger, DriverProfile, profile
from kvlab.experiments.sim.serve.early_stop import SloMissed, stopped_result
from kvlab.experiments.sim.serve.run import ServeSpec, TapFactory, plan, watch
from kvlab.experiments.studies.page_size.settings import Cell, unit_label
from kvlab.experiments.workloads.requests import Request

FLAT = KernelProfile("flat", "a 2x paged slowdown everywhere: the shape the study scales for `none`",
                     (Point("decode", 16, 4096, 2.0), Point("prefill", 16, 4096, 2.0)))


@dataclass(frozen=True, slots=True)
class Costs:
    kernel_scale: float | None = None    # factor on the kernel term's paged slowdown; None: the profile's own
    driver_scale: float = 1.0            # factor on the profile's vmm driver calls


def scaled(base: KernelProfile, k: float) -> KernelProfile:
    points = tuple(replace(p, ratio=1 + k * (p.ratio - 1)) for p in base.points)
    return KernelProfile(f"{base.name} x {k:g}", f"{base.source}, its slowdown scaled by {k:g}", points)


def curve_shape(base: KernelProfile | None) -> KernelProfile:
    """What the kernel scale multiplies: the cell's profile where it charges paged-16 decode anything (block size
    and context stay its axes), else FLAT (`none`, or a profile where paging is free or faster at 16 tokens)."""
    return base if base is not None and base.ratio("decode", 16, 4096) > 1 else FLAT


def kernel_spec(spec: ServeSpec, base: KernelProfile | None, costs: Costs, folder: Path) -> ServeSpec:
    """The spec whose `kernel_costs` is the turned profile, written into `folder` (`none` as it is, untouched)."""
    if costs.kernel_scale is None:
        if base is None:
            return replace(spec, kernel_costs="none")
        turned = base
    else:
        turned = scaled(curve_shape(base), costs.kernel_scale)
    path = folder / "kernel-profile.json"
    path.write_text(json.dumps(turned.to_json()))
    return replace(spec, kernel_costs=f"measured:{path}")


def turned_profile(spec: ServeSpec, costs: Costs, page_size: int | None) -> DriverProfile:
    base = profile(spec.driver_profile, spec.calibration, page_size)
    s = costs.driver_scale
    return replace(base, map_s=base.map_s * s, set_access_s=base.set_access_s * s, unmap_s=base.unmap_s * s)


def requests_for(spec: ServeSpec, rate: float, seed: int) -> list[Request]:
    """run.py's plan; a prefix:KIND dataset's prompts carry token ids, so the prefix cache sees their sharing."""
    if not spec.dataset.startswith("prefix:"):
        return plan(spec, rate, seed)
    from kvlab.experiments.loadgen.arrivals import arrival_times
    from kvlab.experiments.loadgen.datasets import build
    vocab = model_spec(spec.model).config.vocab_size
    loads = build(spec.dataset, spec.num_requests, seed, vocab)
    stamps = arrival_times(len(loads), rate, spec.burstiness, seed).tolist()
    return [Request(len(r.prompt), r.output_len, t, token_ids=r.prompt) for r, t in zip(loads, stamps)]


def run_point(case: SimCase, spec: ServeSpec, costs: Costs, rate: float, seed: int,
              stop_on_miss: dict[str, float] | None) -> dict[str, Any]:
    """`kvlab simulate serve`'s latency keys for one run; stopped early (no figures) once the SLO is missed."""
    requests = requests_for(spec, rate, seed)
    settings = spec.settings(seed)
    page = case.options.get("page_size", case.options.get("elastic_page_size"))
    ledger = CostLedger(turned_profile(spec, costs, page), spec.background_mapping)
    factory = TapFactory(ledger, watch(stop_on_miss, requests, settings))
    try:
        row = run_case(case, settings, requests, tap=factory)
    except SloMissed as missed:
        return stopped_result(missed)
    records = factory.tap.records(factory.added, factory.finished)
    result = latency.summarize(records, row.sim_seconds, percentiles=spec.percentiles, max_concurrent=row.max_batch)
    return {**result, "tokens_per_unit": row.tokens_per_unit}


@dataclass(frozen=True, slots=True)
class SearchJob:
    """One (cell, unit, seed, costs) SLO search: picklable, for a pool worker or a Ray task."""
    cell: Cell
    spec: ServeSpec
    kernel: KernelProfile | None      # the cell's kernel profile, read where the study started (None: `none`)
    case: SimCase
    seed: int
    costs: Costs
    slo: dict[str, float]
    start: float
    tolerance: float
    step: float | None = None       # the first bracket factor (None: slo.bracket_step of the tolerance)


def search(job: SearchJob) -> dict[str, Any]:
    """The highest rate meeting the SLO, its run's output throughput and the unit's size in tokens."""
    with tempfile.TemporaryDirectory(prefix="kvlab-study-") as folder:
        spec = kernel_spec(job.spec, job.kernel, job.costs, Path(folder))
        found = slo.search(lambda rate: run_point(job.case, spec, job.costs, rate, job.seed, job.slo), job.slo,
                           job.start, job.tolerance, step=job.step)
    best = found.results.get(found.rate, {})
    sizes = [r["tokens_per_unit"] for r in found.results.values() if "tokens_per_unit" in r]
    return {"cell": job.cell.label, "unit": unit_label(job.case), "seed": job.seed,
            "kernel_scale": job.costs.kernel_scale, "driver_scale": job.costs.driver_scale, "slo_rate": found.rate,
            "output_throughput": best.get("output_throughput", 0.0), "tokens_per_unit": max(sizes, default=0),
            "runs": len(found.evaluations)}
