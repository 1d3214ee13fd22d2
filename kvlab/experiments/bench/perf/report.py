"""The suite's output: a plain-text table on the console and one JSON file with every sample behind it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvlab.experiments.bench.perf.harness import Result


def format_value(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3g}"


def per_repeat(result: Result) -> list[float]:
    """The row's value in each repeat, when its family recorded them (detail["per_repeat"])."""
    return [v for v in result.detail.get("per_repeat") or [] if v is not None]


def spread(result: Result) -> str:
    values = per_repeat(result)
    return f"{format_value(min(values))}-{format_value(max(values))}" if len(values) > 1 else ""


def verdict(result: Result) -> str:
    """`met` only when every repeat met the goal; `MISSED` when none did; otherwise `within noise`, with the
    count of repeats that met it. A lone median says so instead of claiming more than it shows."""
    if result.goal is None:
        return ""
    values = per_repeat(result)
    if not values:
        return "" if result.met is None else ("met (median only)" if result.met else "MISSED (median only)")
    hits = sum(bool(result.goal.met(v)) for v in values)
    word = "met" if hits == len(values) else "MISSED" if hits == 0 else "within noise"
    return f"{word} {hits}/{len(values)}"


def table(results: list[Result]) -> str:
    headers = ("family", "measurement", "median", "min-max", "unit", "goal", "repeats met", "note")
    rows = [(r.family, r.name, format_value(r.value), spread(r), r.unit, str(r.goal) if r.goal else "", verdict(r),
             r.note) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    numeric = {2, 3}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(headers), line(tuple("-" * w for w in widths))]
    out += [line(row) for row in rows]
    return "\n".join(s.rstrip() for s in out)


def write_json(path: Path, machine: dict[str, Any], settings: dict[str, Any], results: list[Result],
               errors: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine, "settings": settings, "results": [r.to_dict() for r in results], "errors": errors}
    path.write_text(json.dumps(doc, indent=1, default=str))
