"""A sweep's cells: the repeated runs of one backend at one request rate, as a median with its min-max spread, and
each backend's verdict against the first backend at that rate (reporting/verdict.py words it)."""
from __future__ import annotations

import math
from typing import Any

from kvlab.experiments.reporting.verdict import MIN_REPEATS, Interval, judge, sentence, spread

SUMMARISED = ("output_throughput", "request_throughput", "request_goodput", "p50_ttft_ms", "p99_ttft_ms",
              "p50_tpot_ms", "p99_tpot_ms")
JUDGED = {"output_throughput": "output tok/s", "p50_ttft_ms": "p50 TTFT"}


def cells_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (rate, backend) in the order they first appear: its runs and a low/mid/high per figure."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["request_rate"], r["backend"]), []).append(r)
    cells = []
    for (rate, backend), runs in sorted(groups.items(), key=lambda kv: kv[0][0]):
        cell = {"request_rate": rate, "backend": backend, "runs": len(runs)}
        for key in SUMMARISED:
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
            cell[key] = spread(values)._asdict() if values else None
        cells.append(cell)
    add_verdicts(cells)
    return cells


def add_verdicts(cells: list[dict[str, Any]]) -> None:
    """Each cell but the first backend's at its rate gets `verdicts`: one sentence per judged figure."""
    for rate in dict.fromkeys(c["request_rate"] for c in cells):
        mine = [c for c in cells if c["request_rate"] == rate]
        base = mine[0]
        for cell in mine[1:]:
            cell["verdicts"] = [verdict(cell, base, key, what) for key, what in JUDGED.items()]


def verdict(cell: dict[str, Any], base: dict[str, Any], key: str, what: str) -> str:
    runs = min(cell["runs"], base["runs"])
    if runs < MIN_REPEATS:
        return (f"{cell['backend']} against {base['backend']} in {what}: not judged, {runs} run(s) each "
                f"(--repeats {MIN_REPEATS} or more)")
    if cell[key] is None or base[key] is None:
        return f"{cell['backend']} against {base['backend']} in {what}: not judged, no {key} in some run"
    return sentence(cell["backend"], base["backend"], judge(Interval(**base[key]), Interval(**cell[key])), what)


def shown(interval: dict[str, float] | None, digits: str = ".3g") -> str:
    """`median [min-max]`, or the value alone when the runs agree (one run)."""
    if interval is None:
        return "-"
    mid = format(interval["mid"], digits)
    if interval["low"] == interval["high"]:
        return mid
    return f"{mid} [{format(interval['low'], digits)}-{format(interval['high'], digits)}]"


def cell_line(cell: dict[str, Any]) -> str:
    rate = "inf" if math.isinf(cell["request_rate"]) else f"{cell['request_rate']:g}"
    return (f"{cell['backend']:8} rate {rate:>6}: {cell['runs']} run(s), output tok/s "
            f"{shown(cell['output_throughput'])}, p50 TTFT ms {shown(cell['p50_ttft_ms'])} (median [min-max])")
