"""The verdict paragraph, written from the numbers: who wins each cell at the profile's own costs and whether
the intervals separate them, then each vmm unit's break-even kernel ratio r* with its interval (curve.py), or
"not distinguishable" where the 95% band holds the tie at every ratio tried."""
from __future__ import annotations

import math
from typing import Any

from kvlab.experiments.studies.page_size.elasticity import sentence

RATE_LIMIT = 1e5           # slo.search's default high limit: a rate above it passed everywhere
R = "paged/contiguous decode kernel ratio"


def ci(pair: list[float]) -> str:
    return f"[{pair[0]:.3g}, {pair[1]:.3g}]"


def winner_sentence(label: str, cell: dict[str, Any]) -> str:
    units = cell["units"]
    if all(u["slo_rate"] >= RATE_LIMIT for u in units.values()):
        return f"Under {label}, every unit meets the SLO at every rate tried: this workload never loads the server."
    win = max(units, key=lambda u: units[u]["slo_rate"])
    w = units[win]
    others = [u for u in units if u != win]
    if not others:
        return f"Under {label}, only {win} has finished: {w['slo_rate']:.3g} req/s {ci(w['slo_rate_ci95'])}."
    runner = max(others, key=lambda u: units[u]["slo_rate"])
    gap = "beyond" if w["slo_rate_ci95"][0] > units[runner]["slo_rate_ci95"][1] else "within"
    own = cell.get("kernel_ratio_today")
    at = f" (its kernel profile charges paged-16 decode {own:.3g}x contiguous)" if own else ""
    return (f"Under {label}{at}, {win} ({w['tokens_per_unit']} tokens per unit) serves the highest rate meeting "
            f"the SLO, {w['slo_rate']:.3g} req/s {ci(w['slo_rate_ci95'])} at {w['output_throughput']:.4g} output "
            f"tok/s; the runner-up, {runner}, reaches {units[runner]['slo_rate']:.3g} req/s "
            f"{ci(units[runner]['slo_rate_ci95'])}, {gap} the 95% intervals.")


def end(value: float | None, lo: float, hi: float) -> str:
    if value is None:
        return f">{hi:g}"
    return f"<={lo:g}" if value <= lo else f"{value:.3g}"


def interval(b: dict[str, Any]) -> str:
    lo, hi = b["range"]
    return f"[{end(b['ci95'][0], lo, hi)}, {end(b['ci95'][1], lo, hi)}]"


def break_even_sentence(unit: str, b: dict[str, Any], points: list[dict[str, Any]]) -> str:
    lo, hi = b["range"]
    first, last = points[0]["vmm"][unit], points[-1]["vmm"][unit]
    if b["status"] == "indistinguishable":
        mean = f"; the means cross at r = {b['r_star']:.3g}" if b["r_star"] is not None else ""
        return (f"{unit} is not distinguishable from the best paged block anywhere on r = {lo:g}-{hi:g}: its 95% "
                f"band holds 1 at every ratio ({first['ratio']:.3f} {ci(first['ci95'])} at {lo:g}, "
                f"{last['ratio']:.3f} {ci(last['ci95'])} at {hi:g}){mean}.")
    if b["status"] == "leads":
        return (f"{unit} leads the best paged block already at r = {lo:g}: {first['ratio']:.3f} "
                f"{ci(first['ci95'])}; it leads for certain above r = {end(b['ci95'][1], lo, hi)}.")
    if b["status"] == "trails":
        return (f"{unit} trails the best paged block at every r up to {hi:g} ({last['ratio']:.3f} "
                f"{ci(last['ci95'])} at {hi:g}); its break-even lies beyond the curve, if anywhere.")
    return (f"{unit} leads the best paged block above r* = {b['r_star']:.3g} {interval(b)} ({R}; the interval "
            f"runs from where the 95% band first reaches the tie to where it clears it).")


def verdict(cells: dict[str, dict[str, Any]]) -> str:
    sentences = []
    for label, cell in cells.items():
        sentences.append(winner_sentence(label, cell))
        if cell.get("elastic_effects"):
            sentences.append(sentence(label, cell["elastic_effects"]))
        c = cell.get("curve")
        if c:
            sentences.extend(break_even_sentence(u, b, c["points"]) for u, b in c["break_even"].items())
        for unit, f in (cell.get("driver_flips") or {}).items():
            sentences.append(driver_sentence(unit, f))
    return " ".join(sentences)


def driver_sentence(unit: str, f: dict[str, Any]) -> str:
    lo, hi = f["driver_flip_scale"]
    if math.isinf(hi):
        return f"{unit} keeps its lead with driver calls {lo:.4g}x the profile's latency (mean rates)."
    if lo == 0:
        return f"{unit} trails even with driver calls {1 / hi:.4g}x faster than the profile's (mean rates)."
    if f["leads_today"]:
        return f"{unit} loses the lead once driver calls take {lo:.3g}-{hi:.3g}x the profile's latency (mean rates)."
    return f"{unit} would lead only with driver calls at {lo:.3g}-{hi:.3g}x the profile's latency (mean rates)."
