"""Plain-text tables and number formatting for the experiments' console output."""
from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fmt(value: Any, digits: int = 1) -> str:
    """Thousands separators for big numbers, `digits` decimals for small ones, '-' for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Left-align the first column, right-align the rest; cells are formatted with `fmt`."""
    cells = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def beside(ours: Any, article: Any, formatter=fmt) -> str:
    """`ours (article)`, or just ours when the article gives no figure."""
    if article is None:
        return formatter(ours)
    return f"{formatter(ours)} ({formatter(article)})"


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Flat CSV of dict rows; nested values (dicts, lists) are written as their repr."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (v if isinstance(v, (int, float, str)) or v is None else repr(v))
                             for k, v in row.items()})
