"""The printed report: one table per cell, then the verdict paragraph."""
from __future__ import annotations

import math
from typing import Any

from kvlab.experiments.studies.page_size.settings import StudySettings


def bracket(pair: list[float] | None, fmt: str) -> str:
    if not pair:
        return "-"
    hi = "inf" if math.isinf(pair[1]) else format(pair[1], fmt)
    return f"[{format(pair[0], fmt)}, {hi}]"


def cell_table(label: str, cell: dict[str, Any]) -> str:
    from kvlab.experiments.reporting.tables import table
    body = []
    for unit, u in cell["units"].items():
        f = cell.get("flips", {}).get(unit, {})
        r = u["ratio_to_best_paged"]
        body.append([unit, u["tokens_per_unit"], f"{u['slo_rate']:.3g} {bracket(u['slo_rate_ci95'], '.3g')}",
                     f"{u['output_throughput']:.4g}", f"{r['ratio']:.3f} {bracket(r['ci95'], '.3f')}",
                     bracket(f.get("break_even_decode_slowdown"), ".3g"), bracket(f.get("driver_flip_scale"), ".3g")])
    head = ["unit", "tokens/unit", "SLO rate req/s [95% CI]", "output tok/s", f"x {cell['best_paged']} [95% CI]",
            "break-even paged decode slowdown", "driver flip x profile"]
    return table(head, body, label)


def report(s: StudySettings, result: dict[str, Any]) -> str:
    spec = s.spec
    goal = ", ".join(f"{k} <= {v:g}" for k, v in s.slo.items())
    head = (f"{spec.model} on {spec.hardware}, {spec.num_requests} requests ({spec.dataset}), {len(s.seeds)} paired "
            f"seeds, KV budget {s.budget_gb:g} GB per GPU, SLO {goal}")
    tables = [cell_table(label, cell) for label, cell in result["cells"].items()]
    return "\n\n".join([head, *tables, "Verdict: " + result["verdict"],
                        f"({result['host_seconds']:.0f} s host time)"])
