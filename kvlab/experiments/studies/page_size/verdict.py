"""The verdict paragraph, written from the numbers: who wins each cell and by how much, whether the intervals
separate them, and how far each vmm page size is from a flip."""
from __future__ import annotations

import math
from typing import Any

RATE_LIMIT = 1e5           # slo.search's default high limit: a rate above it passed everywhere


def ci(pair: list[float]) -> str:
    return f"[{pair[0]:.3g}, {pair[1]:.3g}]"


def separated(ratio: dict[str, Any]) -> bool:
    lo, hi = ratio["ci95"]
    return lo > 1 or hi < 1


def winner_sentence(label: str, cell: dict[str, Any]) -> str:
    units = cell["units"]
    if all(u["slo_rate"] >= RATE_LIMIT for u in units.values()):
        return f"Under {label}, every unit meets the SLO at every rate tried: this workload never loads the server."
    win = max(units, key=lambda u: units[u]["slo_rate"])
    w = units[win]
    others = [u for u in units if u != win]
    runner = max(others, key=lambda u: units[u]["slo_rate"])
    gap = "beyond" if w["slo_rate_ci95"][0] > units[runner]["slo_rate_ci95"][1] else "within"
    return (f"Under {label}, {win} ({w['tokens_per_unit']} tokens per unit) serves the highest rate meeting the "
            f"SLO, {w['slo_rate']:.3g} req/s {ci(w['slo_rate_ci95'])} at {w['output_throughput']:.4g} output tok/s; "
            f"the runner-up, {runner}, reaches {units[runner]['slo_rate']:.3g} req/s "
            f"{ci(units[runner]['slo_rate_ci95'])}, {gap} the 95% intervals.")


def kernel_clause(f: dict[str, Any]) -> str:
    lo, hi = f["break_even_decode_slowdown"]
    today = f"the profile's: {f['decode_slowdown_today']:.3g}x"
    if f["break_even_kernel_scale"][0] == 0:
        return "it leads even with paged kernels as fast as contiguous ones"
    if math.isinf(hi):
        return f"it does not overtake even with paged decode attention {lo:.3g}x as slow as contiguous ({today})"
    verb = "it would lose the lead if" if f["leads_today"] else "it overtakes once"
    return f"{verb} paged decode attention is {lo:.3g}-{hi:.3g}x as slow as contiguous ({today})"


def driver_clause(f: dict[str, Any]) -> str:
    scale = f["driver_flip_scale"]
    if scale is None:
        return ""
    lo, hi = scale
    if math.isinf(hi):
        return f"it keeps its lead with driver calls {lo:.4g}x the profile's latency"
    if lo == 0:
        return f"it trails even with driver calls {1 / hi:.4g}x faster than the profile's"
    if f["leads_today"]:
        return f"it loses the lead again once driver calls take {lo:.3g}-{hi:.3g}x the profile's latency"
    return f"with the profile's kernels it would lead only with driver calls at {lo:.3g}-{hi:.3g}x its latency"


def flip_sentence(unit: str, cell: dict[str, Any]) -> str:
    f, u = cell["flips"][unit], cell["units"][unit]
    ratio = u["ratio_to_best_paged"]
    head = (f"{unit} reaches {ratio['ratio']:.3f} {ci(ratio['ci95'])} of {cell['best_paged']}'s rate"
            f"{'' if separated(ratio) else ' (no significant difference)'}")
    clauses = [c for c in (kernel_clause(f), driver_clause(f)) if c]
    return f"{head}; " + "; ".join(clauses) + "."


def verdict(cells: dict[str, dict[str, Any]]) -> str:
    sentences = []
    for label, cell in cells.items():
        sentences.append(winner_sentence(label, cell))
        sentences.extend(flip_sentence(u, cell) for u in cell.get("flips", {}))
    return " ".join(sentences)
