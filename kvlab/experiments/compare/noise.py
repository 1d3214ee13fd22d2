"""What an unchanged part of two runs shows about noise. A row (a backend, a case) whose configuration is the
same in both runs (every setting that differs belongs to another row, e.g. `--page-size` changes only vmm's
options) is a noise control: how far its figures moved is what the machine and the repeats alone did, and a
difference elsewhere counts as real only beyond it. With the same configuration in both runs, every row is one."""
from __future__ import annotations

from typing import Any

from kvlab.common.validate import as_finite
from kvlab.experiments.reporting.verdict import relative_change

Key = tuple


def row_name(key: Key) -> set[str]:
    return {str(v) for _, v in key}


def unchanged_rows(keys: list[Key], changed_paths: list[str]) -> list[Key]:
    """The rows no changed setting belongs to. A changed setting belongs to a row when its dotted path names the
    row (`engine.vmm.vmm.page_size` belongs to the vmm row); a change that names no row belongs to every row."""
    if not changed_paths:
        return list(keys)
    names = set().union(*(row_name(k) for k in keys)) if keys else set()
    owners = [set(path.split(".")) & names for path in changed_paths]
    if any(not owner for owner in owners):
        return []
    touched = set().union(*owners)
    return [k for k in keys if not row_name(k) & touched]


def noise_by_figure(rows_a: dict[Key, dict[str, Any]], rows_b: dict[Key, dict[str, Any]], controls: list[Key],
                    spread: Any) -> dict[str, float]:
    """figure -> the largest |relative change| of its median over the control rows (0 where they held still)."""
    noise: dict[str, float] = {}
    for key in controls:
        a, b = rows_a.get(key), rows_b.get(key)
        if a is None or b is None:
            continue
        for figure, value in a.items():
            if is_number(value) and is_number(b.get(figure)):
                moved = abs(relative_change(middle(spread(a, figure)), middle(spread(b, figure))))
                noise[figure] = max(noise.get(figure, 0.0), moved)
    return noise


def middle(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def is_number(value: Any) -> bool:
    """A figure: a number a float holds (10**400 in a hand-edited file is not one)."""
    return isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)
                                        and as_finite(value) is not None)


def load_lines(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The machine's load at each run's start (1-min load average), as a difference like any setting."""
    la, lb = (p.get("machine", {}).get("load_average") for p in (a, b))
    if not (isinstance(la, list) and isinstance(lb, list) and la and lb):
        return ["machine load: not recorded in both runs (timed figures cannot be told from load)"]
    cpus = a.get("machine", {}).get("logical_cpus") or "?"
    line = f"machine load (1-min load average at the start, {cpus} CPUs): A {la[0]:.2f} -> B {lb[0]:.2f}"
    if abs(la[0] - lb[0]) >= 1:
        line += "; the runs shared the machine differently, so timed figures move with it"
    return [line]
