"""A cell's figures from its searches: each unit's SLO rate and throughput with bootstrap 95% intervals over the
seeds and its rate's ratio to the best paged block size, paired by seed (sim/serve/summary.py and stats.py), at
the profile's own costs; and the curve of each vmm unit's ratio against the kernel ratio (curve.py). Only units
and curve points whose every seed is done enter (an interrupted study's partial report)."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.serve.stats import bootstrap_mean
from kvlab.experiments.sim.serve.summary import slo_summary
from kvlab.experiments.studies.page_size import curve, elasticity


def per_seed(searches: list[dict[str, Any]], unit: str, key: str) -> list[float]:
    mine = sorted((r for r in searches if r["unit"] == unit), key=lambda r: r["seed"])
    return [r[key] for r in mine]


def complete(searches: list[dict[str, Any]], units: list[str], seeds: int) -> list[str]:
    return [u for u in units if len(per_seed(searches, u, "slo_rate")) == seeds]


def cell_summary(searches: list[dict[str, Any]], units: list[str], seeds: int) -> dict[str, Any] | None:
    """searches: the cell's searches at the profile's own costs; None until a paged unit has every seed."""
    units = complete(searches, units, seeds)
    paged = [u for u in units if u.startswith("paged-")]
    if not paged:
        return None
    rates = {u: per_seed(searches, u, "slo_rate") for u in units}
    best_paged = max(paged, key=lambda u: sum(rates[u]))
    folded = slo_summary(rates, best_paged)
    out = {}
    for u in units:
        mean, lo, hi = bootstrap_mean(per_seed(searches, u, "output_throughput"))
        out[u] = {"slo_rate": folded["backends"][u]["slo_rate"], "slo_rate_ci95": folded["backends"][u]["ci95"],
                  "per_seed": rates[u], "output_throughput": mean, "output_throughput_ci95": [lo, hi],
                  "tokens_per_unit": max(per_seed(searches, u, "tokens_per_unit")),
                  "ratio_to_best_paged": folded["ratios"].get(u, {"ratio": 1.0, "ci95": [1.0, 1.0]})}
    summary = {"best_paged": best_paged, "units": out}
    split = elasticity.effects(rates, best_paged)
    return {**summary, "elastic_effects": split} if split else summary


def curve_summary(searches: list[dict[str, Any]], today: list[dict[str, Any]], scales: dict[float, float],
                  paged: list[str], vmm: list[str], seeds: int) -> dict[str, Any] | None:
    """scales: kernel ratio r -> the kernel scale its searches ran at. vmm runs contiguous kernels, so its rates
    are the profile's own at every r. None until the vmm units and one curve point are complete."""
    vmm = complete(today, vmm, seeds)
    if not vmm:
        return None
    points = []
    for r, k in sorted(scales.items()):
        at_r = [x for x in searches if x["kernel_scale"] == k and x["driver_scale"] == 1.0]
        if len(complete(at_r, paged, seeds)) < len(paged):
            continue
        rates = {u: per_seed(at_r, u, "slo_rate") for u in paged} | {u: per_seed(today, u, "slo_rate") for u in vmm}
        points.append(curve.curve_point(r, rates, paged, vmm))
    if not points:
        return None
    return {"points": points, "break_even": curve.break_evens(points, vmm)}
