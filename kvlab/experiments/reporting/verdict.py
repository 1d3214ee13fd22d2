"""The one place that decides, in words, whether B differs from A: `significantly higher`, `significantly lower`
or `not distinguishable`, from intervals (the min-max of repeated runs, or a bootstrap interval of a ratio).

bench, bench serve and compare word their verdicts here; the page-size study adopts it for its ratio intervals.
A difference is claimed only when the intervals do not overlap AND the change exceeds `noise`, the relative
change that something known to be unchanged showed (an unchanged backend between two runs, or repeats)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

HIGHER = "significantly higher"
LOWER = "significantly lower"
SAME = "not distinguishable"
MIN_REPEATS = 3            # with 2 runs each, disjoint ranges happen by chance 1 time in 3; with 3, 1 in 10


class Interval(NamedTuple):
    low: float
    mid: float
    high: float


def spread(values: Sequence[float]) -> Interval:
    """min, median, max of repeated runs."""
    ordered = sorted(values)
    n = len(ordered)
    mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return Interval(ordered[0], mid, ordered[-1])


def relative_change(a: float, b: float) -> float:
    """(b - a) / |a|; infinite when a is 0 and b is not."""
    if a == 0:
        return 0.0 if b == 0 else float("inf")
    return (b - a) / abs(a)


def judge(a: Interval, b: Interval, noise: float = 0.0) -> str:
    """B against A: HIGHER when B's interval lies wholly above A's and its median moved by more than `noise`
    (relative), LOWER the mirror, else SAME."""
    moved = abs(relative_change(a.mid, b.mid)) > noise
    if b.low > a.high and moved:
        return HIGHER
    if b.high < a.low and moved:
        return LOWER
    return SAME


def judge_ratio(low: float, high: float, noise: float = 0.0) -> str:
    """A ratio B/A with its interval [low, high] (e.g. a paired bootstrap): HIGHER when it excludes 1 from above
    by more than `noise`, LOWER from below, else SAME."""
    if low > 1 + noise:
        return HIGHER
    if high < 1 - noise:
        return LOWER
    return SAME


def sentence(name_b: str, name_a: str, word: str, what: str = "") -> str:
    """`vmm is significantly higher than paged in output tok/s` / `vmm and paged are not distinguishable in ...`."""
    tail = f" in {what}" if what else ""
    if word == SAME:
        return f"{name_b} and {name_a} are {SAME}{tail}"
    return f"{name_b} is {word} than {name_a}{tail}"


def too_few(runs_a: int, runs_b: int) -> bool:
    return min(runs_a, runs_b) < MIN_REPEATS


def short_run_warning(requests: int, enough: int, what: str = "absolute rates") -> str | None:
    """A warning when a run of `requests` is too short for its absolute figures: the start (an empty system) and
    the drain (the last requests alone) are a large share of it, so it overstates `what`; ratios between layouts
    run on the same requests are less affected."""
    if requests >= enough:
        return None
    return (f"warning: {requests} requests is a short run: the start (an empty system) and the drain (the last "
            f"requests alone) are a large share of it, so its {what} are not a steady state's; compare ratios, or "
            f"run >= {enough} requests for absolute figures")
