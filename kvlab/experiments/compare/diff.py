"""Two saved runs side by side: the configuration that differs first (the cause), then the software, machine and
its load, then every figure of every row they share, with its spread over repeats or its interval where the run
kept one. A difference is called real only beyond what the runs' noise controls moved (compare/noise.py) and
beyond the repeats' spread; the words come from reporting/verdict.py."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.compare.noise import is_number, load_lines, noise_by_figure, unchanged_rows
from kvlab.experiments.compare.saved import SavedRun
from kvlab.experiments.reporting import verdict as words
from kvlab.experiments.reporting.tables import fmt, median

MACHINE_KEYS = ("cpu", "logical_cpus", "gpu", "python", "platform")
ABSENT = object()


def compare(a: SavedRun, b: SavedRun, show_equal: bool = False) -> str:
    lines = [f"A: {a.path}", f"B: {b.path}"]
    lines += [f"{name}: {run.provenance['note']}" for name, run in (("A", a), ("B", b)) if run.provenance.get("note")]
    config_a, config_b = a.provenance.get("config", {}), b.provenance.get("config", {})
    lines += section("configuration", config_a, config_b)
    lines += section("software and machine", environment(a.provenance), environment(b.provenance))
    lines += load_lines(a.provenance, b.provenance)
    shared = [k for k in a.rows if k in b.rows]
    controls = unchanged_rows(shared, [path for path, _, _ in differences(config_a, config_b)])
    noise = noise_by_figure(a.rows, b.rows, controls, spread)
    lines += control_lines(controls, shared)
    lines += figure_lines(a, b, show_equal, set(controls), noise)
    return "\n".join(lines)


def control_lines(controls: list[tuple], shared: list[tuple]) -> list[str]:
    if not controls:
        return ["noise control: none (every row's configuration changed); a difference is called real only where "
                "the repeats' ranges or intervals do not overlap"]
    names = "; ".join(row_label(k) for k in controls)
    if len(controls) == len(shared):
        return [f"noise control: the configuration is the same in A and B, so every difference below is the "
                f"machine's and the repeats' noise ({names})"]
    return [f"noise control: {names} ran the same configuration in A and B; how far its figures moved is the "
            "noise, and a difference in another row is called real only beyond it and beyond the repeats' spread"]


def row_label(key: tuple) -> str:
    return ", ".join(str(v) for _, v in key) or "run"


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


def figure_lines(a: SavedRun, b: SavedRun, show_equal: bool, controls: set[tuple] = frozenset(),
                 noise: dict[str, float] | None = None) -> list[str]:
    lines = ["figures (A -> B):"]
    for key in [*a.rows, *(k for k in b.rows if k not in a.rows)]:
        name = row_label(key) + (" (noise control)" if key in controls else "")
        if key not in a.rows or key not in b.rows:
            lines.append(f"  {name}: only in {'A' if key in a.rows else 'B'}")
            continue
        compared = [line for line in row_lines(a.rows[key], b.rows[key], show_equal, noise or {}, key in controls)
                    if line]
        lines += [f"  {name}:", *(f"    {line}" for line in compared)] if compared else [f"  {name}: figures equal"]
    return lines


def row_lines(a: dict[str, Any], b: dict[str, Any], show_equal: bool, noise: dict[str, float],
              control: bool) -> list[str]:
    """Every figure both rows have; `control`: the row is itself a noise control."""
    return [figure(key, spread(a, key), spread(b, key), show_equal, noise, control) for key, value in a.items()
            if is_number(value) and is_number(b.get(key)) and not key.endswith("_ci95")]


def spread(row: dict[str, Any], key: str) -> list[float]:
    """Every repeat's value of a figure where the run kept them (bench's `repeats`, `repeats_<figure>`), or its
    interval (`<figure>_ci95`: low and high around the value), else its one value."""
    repeats = row.get("repeats")
    values = repeats.get(key) if isinstance(repeats, dict) else row.get(f"repeats_{key}")
    known = [v for v in values if is_number(v)] if isinstance(values, list) else []
    interval = row.get(f"{key}_ci95")
    if not known and isinstance(interval, list) and len(interval) == 2 and all(map(is_number, interval)):
        known = [interval[0], row[key], interval[1]]
    return known or [row[key]]


def figure(key: str, a: list[float], b: list[float], show_equal: bool, noise: dict[str, float] | None = None,
           control: bool = False) -> str:
    """One figure in words: real (significantly higher / lower) only when the repeats or intervals do not
    overlap and the change exceeds what the noise controls moved; a control's own change is called noise."""
    ma, mb = median(a), median(b)
    if a == b or (len(a) == 1 and len(b) == 1 and ma == mb):
        return f"{key}: {num(ma)} (equal)" if show_equal else ""
    moved = f"{num(ma)} -> {num(mb)} ({change(ma, mb)}"
    if control:
        return f"{key}: {moved}; configuration unchanged: this is noise, not a result)"
    limit = (noise or {}).get(key)
    beyond = "" if limit is None else f", beyond the noise controls' {100 * limit:.1f}%"
    within = "" if limit is None else f", within the noise controls' {100 * limit:.1f}%"
    if len(a) > 1 and len(b) > 1:
        ranges = f"A {num(min(a))}-{num(max(a))}, B {num(min(b))}-{num(max(b))} over {len(a)} and {len(b)} values"
        word = words.judge(words.spread(a), words.spread(b), limit or 0.0)
        if word == words.SAME:
            return f"{key}: {words.SAME}, {moved}; {ranges}{within if limit is not None else ', overlapping'})"
        return f"{key}: {word} in B, {moved}; {ranges}{beyond})"
    if limit is None:
        return f"{key}: {moved}; one value each, no spread)"
    real = abs(words.relative_change(ma, mb)) > limit
    word = (words.HIGHER if mb > ma else words.LOWER) if real else words.SAME
    return f"{key}: {word}{' in B' if real else ''}, {moved}; one value each{beyond if real else within})"


def num(value: float) -> str:
    return fmt(value, 3)


def change(a: float, b: float) -> str:
    return "from 0" if a == 0 else f"{100 * (b - a) / abs(a):+.1f}%"
