"""Two saved runs side by side: the configuration that differs first (the cause), then the software and machine,
then every figure of every row they share, with its spread over repeats where the run kept one."""
from __future__ import annotations

from typing import Any

from kvlab.common.validate import as_finite
from kvlab.experiments.compare.saved import SavedRun
from kvlab.experiments.reporting.tables import fmt, median

MACHINE_KEYS = ("cpu", "logical_cpus", "gpu", "python", "platform")
ABSENT = object()


def compare(a: SavedRun, b: SavedRun, show_equal: bool = False) -> str:
    lines = [f"A: {a.path}", f"B: {b.path}"]
    lines += section("configuration", a.provenance.get("config", {}), b.provenance.get("config", {}))
    lines += section("software and machine", environment(a.provenance), environment(b.provenance))
    lines += figure_lines(a, b, show_equal)
    return "\n".join(lines)


def section(title: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs under `title` (A -> B), or that nothing does."""
    changed = differences(a, b)
    if not changed:
        return [f"{title}: the same"]
    return [f"{title} differs (A -> B):", *(f"  {key}: {show(va)} -> {show(vb)}" for key, va, vb in changed)]


def environment(record: dict[str, Any]) -> dict[str, Any]:
    machine = record.get("machine", {})
    return {"kvlab": record.get("kvlab"), "torch": record.get("torch"),
            "machine": {k: machine.get(k) for k in MACHINE_KEYS}}


def differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, A's value, B's value) of every setting that differs, in A's order; a table only one side
    has is one difference, not one per setting in it."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [] if a == b else [(path, a, b)]
    out = []
    for key in [*a, *(k for k in b if k not in a)]:
        out += differences(a.get(key, ABSENT), b.get(key, ABSENT), f"{path}.{key}" if path else str(key))
    return out


def show(value: Any) -> str:
    if value is ABSENT:
        return "(absent)"
    if isinstance(value, dict):
        return f"(a table of {len(value)} settings)"
    if isinstance(value, list):
        return "[" + ", ".join(map(show, value)) + "]"
    return fmt(value, 3)


def figure_lines(a: SavedRun, b: SavedRun, show_equal: bool) -> list[str]:
    lines = ["figures (A -> B):"]
    for key in [*a.rows, *(k for k in b.rows if k not in a.rows)]:
        name = ", ".join(str(v) for _, v in key) or "run"
        if key not in a.rows or key not in b.rows:
            lines.append(f"  {name}: only in {'A' if key in a.rows else 'B'}")
            continue
        compared = [line for line in row_lines(a.rows[key], b.rows[key], show_equal) if line]
        lines += [f"  {name}:", *(f"    {line}" for line in compared)] if compared else [f"  {name}: figures equal"]
    return lines


def row_lines(a: dict[str, Any], b: dict[str, Any], show_equal: bool) -> list[str]:
    return [figure(key, spread(a, key), spread(b, key), show_equal) for key, value in a.items()
            if is_number(value) and is_number(b.get(key))]


def is_number(value: Any) -> bool:
    """A figure: a number a float holds (10**400 in a hand-edited file is not one)."""
    return isinstance(value, float) or (isinstance(value, int) and as_finite(value) is not None)


def spread(row: dict[str, Any], key: str) -> list[float]:
    """Every repeat's value of a figure where the run kept them (bench's `repeats`), else its one value."""
    repeats = row.get("repeats")
    values = repeats.get(key) if isinstance(repeats, dict) else None
    known = [v for v in values if is_number(v)] if isinstance(values, list) else []
    return known or [row[key]]


def figure(key: str, a: list[float], b: list[float], show_equal: bool) -> str:
    """One figure: `no significant difference` where the repeats overlap, else the change by median."""
    if len(a) > 1 and len(b) > 1:
        ranges = f"A {num(min(a))}-{num(max(a))}, B {num(min(b))}-{num(max(b))} over {len(a)} and {len(b)} runs"
        if min(a) <= max(b) and min(b) <= max(a):
            return f"{key}: no significant difference ({ranges})"
        return f"{key}: {num(median(a))} -> {num(median(b))} ({change(median(a), median(b))}; {ranges}, disjoint)"
    if a == b:
        return f"{key}: {num(a[0])} (equal)" if show_equal else ""
    return f"{key}: {num(median(a))} -> {num(median(b))} ({change(median(a), median(b))}; one value each, no spread)"


def num(value: float) -> str:
    return fmt(value, 3)


def change(a: float, b: float) -> str:
    return "from 0" if a == 0 else f"{100 * (b - a) / abs(a):+.1f}%"
