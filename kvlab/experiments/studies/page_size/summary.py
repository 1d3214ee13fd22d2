"""A cell's figures: each unit's SLO rate and throughput with bootstrap 95% intervals over the seeds, and its
rate's ratio to the best paged block size, paired by seed (sim/serve/summary.py and stats.py)."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.serve.stats import bootstrap_mean
from kvlab.experiments.sim.serve.summary import slo_summary


def per_seed(searches: list[dict[str, Any]], unit: str, key: str) -> list[float]:
    mine = sorted((r for r in searches if r["unit"] == unit), key=lambda r: r["seed"])
    return [r[key] for r in mine]


def cell_summary(searches: list[dict[str, Any]], units: list[str]) -> dict[str, Any]:
    """searches: the cell's searches at the profile's own costs."""
    rates = {u: per_seed(searches, u, "slo_rate") for u in units}
    best_paged = max((u for u in units if u.startswith("paged-")), key=lambda u: sum(rates[u]))
    folded = slo_summary(rates, best_paged)
    out = {}
    for u in units:
        mean, lo, hi = bootstrap_mean(per_seed(searches, u, "output_throughput"))
        out[u] = {"slo_rate": folded["backends"][u]["slo_rate"], "slo_rate_ci95": folded["backends"][u]["ci95"],
                  "per_seed": rates[u], "output_throughput": mean, "output_throughput_ci95": [lo, hi],
                  "tokens_per_unit": max(per_seed(searches, u, "tokens_per_unit")),
                  "ratio_to_best_paged": folded["ratios"].get(u, {"ratio": 1.0, "ci95": [1.0, 1.0]})}
    return {"best_paged": best_paged, "units": out}
