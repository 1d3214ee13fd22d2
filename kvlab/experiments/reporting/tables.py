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
    """Flat CSV of dict rows; a nested value (dict, list) is written as JSON, never as a Python repr."""
    import json
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (v if isinstance(v, (int, float, str)) or v is None else json.dumps(v, default=str))
                             for k, v in row.items()})


def workload_changes(spec: Any, scale_given: bool, default_scale: float = 1.0) -> list[str]:
    """Every transformation a run applies to its workload, in words, for the run's header (none is silent)."""
    changes = []
    if spec.scale != 1:
        why = "--scale" if scale_given else f"default for {spec.kind}; --scale 1 keeps the lengths"
        changes.append(f"every length x{spec.scale:g} ({why})")
    if spec.kind == "trace":
        total = sum(1 for line in Path(spec.trace).read_text().splitlines() if line.strip())
        if total > spec.num_requests:
            changes.append(f"first {spec.num_requests} of the trace's {total} requests (--num-requests)")
    else:
        limit = max(1, round(spec.max_len * spec.scale))
        changes.append(f"prompts cut so prompt + output <= {limit} (--max-len {spec.max_len}"
                       f"{f' x {spec.scale:g}' if spec.scale != 1 else ''})")
    return changes


def changes_line(spec: Any, scale_given: bool, default_scale: float = 1.0) -> str:
    return f"workload changes: {'; '.join(workload_changes(spec, scale_given, default_scale)) or 'none'}"


# -- spread across repeats -------------------------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def with_spread(values: Sequence[float | None], formatter=fmt) -> str:
    """`median [min-max]` over repeats; just the value for one repeat."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    if len(known) == 1:
        return formatter(known[0])
    return f"{formatter(median(known))} [{formatter(min(known))}-{formatter(max(known))}]"


def verdict(name_a: str, a: Sequence[float], name_b: str, b: Sequence[float], unit: str = "tok/s") -> str:
    """Plain words on two backends' repeated runs (worded by reporting/verdict.py): a difference is claimed only
    when every run of one beats every run of the other (disjoint ranges; by chance 1 time in 10 with 3 runs
    each, less with more), otherwise the two are not distinguishable."""
    from kvlab.experiments.reporting import verdict as words
    if words.too_few(len(a), len(b)):
        return (f"{name_a} vs {name_b}: too few runs to tell ({', '.join(map(fmt, a))} vs {', '.join(map(fmt, b))} "
                f"{unit}); use --repeats {words.MIN_REPEATS} or more")
    ranges = f"{name_a} {fmt(min(a))}-{fmt(max(a))}, {name_b} {fmt(min(b))}-{fmt(max(b))} {unit} over {len(a)} runs"
    word = words.judge(words.spread(b), words.spread(a))
    said = words.sentence(name_a, name_b, word, unit)
    if word == words.SAME:
        return f"{said}: the runs overlap ({ranges})"
    ratio = median(a) / max(median(b), 1e-12)
    return f"{said} in every run, x{ratio:.2f} by median ({ranges})"


# -- progress --------------------------------------------------------------------------------------------------

LOG_INTERVAL_S = 30.0     # a log that is not a terminal gets one progress line this often, not one per update


def progress_bar(iterable: Any = None, **kwargs: Any):
    """tqdm that redraws in place on a terminal and writes a line at most every LOG_INTERVAL_S into a log
    (a redirected stderr), so long runs are never silent and never flood a file. In a log the bar always ends
    with its final line: a bar that would erase itself on a terminal (leave=False) can only blank its line there,
    which runs its last update into whatever is printed next."""
    import sys

    from tqdm import tqdm
    if sys.stderr.isatty():
        return tqdm(iterable, **kwargs)

    class LogBar(tqdm):
        """A new description or postfix waits for the next timed line instead of forcing one."""

        def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
            super().set_description(desc, refresh=False)

        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            super().set_postfix_str(s, refresh=False)

    return LogBar(iterable, **{"mininterval": LOG_INTERVAL_S, "maxinterval": LOG_INTERVAL_S * 2, "ascii": True,
                               **kwargs, "leave": True})


def results_dir(out: str | Path | None, suffix: str = "") -> Path:
    """--out, or results/<timestamp><suffix>/ (a new directory: a run in the same second gets -2, -3...)."""
    if out:
        return Path(out)
    import time
    base = Path("results") / (time.strftime("%Y%m%d-%H%M%S") + suffix)
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def threads_label(threads: int) -> str:
    """`1 thread`, `4 threads`, or torch's own count when the config says 0."""
    if not threads:
        import torch
        return f"{torch.get_num_threads()} threads (torch default)"
    return f"{threads} thread{'s' if threads != 1 else ''}"
