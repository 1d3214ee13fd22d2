"""The verdict as a curve: each vmm unit's SLO rate over the best paged block size's (paired bootstrap 95%
interval over the seeds) at each paged/contiguous kernel ratio r, and the break-even r* where vmm starts to lead.

r is paged decode attention time over contiguous at 16-token blocks and 4,096-token contexts; the cell's kernel
profile gives the shape over block sizes and contexts (docs/study.md). The break-even is where the mean ratio
crosses 1 (linear between curve points); its interval is where the 95% band's upper edge crosses 1 (below it vmm
trails for certain) and where its lower edge does (above it vmm leads for certain)."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.kernels import KernelProfile
from kvlab.experiments.sim.serve.summary import slo_summary

REFERENCE = ("decode", 16, 4096)       # where r is read off a profile


def reference_ratio(profile: KernelProfile) -> float:
    return profile.ratio(*REFERENCE)


def scale_for(shape: KernelProfile, r: float) -> float:
    """The factor on `shape`'s slowdown that makes its reference ratio r (study/point.py's `scaled`)."""
    return (r - 1) / (reference_ratio(shape) - 1)


def crossing(xs: list[float], ys: list[float], level: float = 1.0) -> float | None:
    """The first x where y rises through `level` (linear between points); xs[0] when y starts at or above it;
    None when it stays below."""
    if not xs:
        return None
    if ys[0] >= level:
        return xs[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 < level <= y1:
            return x0 + (level - y0) * (x1 - x0) / (y1 - y0)
    return None


def break_even(xs: list[float], mean: list[float], low: list[float], high: list[float]) -> dict[str, Any]:
    """r*, and the interval [where the band's upper edge reaches 1, where its lower edge does].

    status: "leads" (vmm leads at every r: r* at or below xs[0]), "trails" (never reaches the tie), "crosses",
    or "indistinguishable" (the band holds 1 at every r). An end the curve does not reach is None (beyond xs[-1])."""
    r_star, lo, hi = crossing(xs, mean), crossing(xs, high), crossing(xs, low)
    if all(a <= 1 <= b for a, b in zip(low, high)):
        status = "indistinguishable"
    elif r_star is None:
        status = "trails"
    elif r_star == xs[0] and mean[0] > 1:
        status = "leads"
    else:
        status = "crosses"
    return {"status": status, "r_star": r_star, "ci95": [lo, hi], "range": [xs[0], xs[-1]]}


def curve_point(r: float, rates: dict[str, list[float]], paged: list[str], vmm: list[str]) -> dict[str, Any]:
    """One r: the best paged unit (highest mean rate) and each vmm unit's ratio to it, paired by seed."""
    best = max(paged, key=lambda u: sum(rates[u]))
    folded = slo_summary({u: rates[u] for u in [best, *vmm]}, best)
    return {"kernel_ratio": r, "best_paged": best,
            "paged_rates": {u: sum(rates[u]) / len(rates[u]) for u in paged},
            "vmm": {u: folded["ratios"][u] for u in vmm}}


def break_evens(points: list[dict[str, Any]], vmm: list[str]) -> dict[str, dict[str, Any]]:
    xs = [p["kernel_ratio"] for p in points]
    out = {}
    for u in vmm:
        ratios = [p["vmm"][u] for p in points]
        out[u] = break_even(xs, [q["ratio"] for q in ratios], [q["ci95"][0] for q in ratios],
                            [q["ci95"][1] for q in ratios])
    return out
