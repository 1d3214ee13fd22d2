"""SLO search: the highest request rate whose result meets every target (bracket by doubling or halving, then
bisect geometrically to a relative tolerance). `evaluate(rate) -> result dict` is any service model."""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_number

SLO_RE = re.compile(r"\s*(\w+)\s*<=\s*([0-9]*\.?[0-9]+)\s*")


def parse_slo(text: str) -> dict[str, float]:
    """'p99_ttft_ms<=2000,p99_tpot_ms<=100' -> {"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0}."""
    out = {}
    for part in text.split(","):
        m = SLO_RE.fullmatch(part)
        if not m:
            raise ConfigError(f"bad --slo item {part!r}: use KEY<=NUMBER, e.g. p99_ttft_ms<=2000")
        key = m.group(1)
        if key in out:
            raise ConfigError(f"--slo names {key} twice; give each target once")
        out[key] = check_number(f"--slo {key}", float(m.group(2)))
    return out


def meets(result: dict[str, Any], slo: dict[str, float]) -> bool:
    if result.get("stopped_early"):               # run_point stopped it: the SLO was certainly missed
        return False
    for key, limit in slo.items():
        if key not in result:
            raise ConfigError(f"SLO key {key!r} is not a result key (e.g. p99_ttft_ms, p99_tpot_ms, p50_e2el_ms)")
        if not (result["failed"] == 0 and result[key] <= limit):
            return False
    return True


@dataclass(slots=True)
class SearchResult:
    rate: float                                   # highest passing rate (or integer, search_int) found (0: none)
    evaluations: list[tuple[float, bool]] = field(default_factory=list)
    results: dict[float, dict[str, Any]] = field(default_factory=dict)


def _judged(x: Any, slo: dict[str, float], out: SearchResult) -> Generator[Any, dict[str, Any], bool]:
    """Yield `x` to be evaluated; the result sent back is judged by `meets` and recorded in `out`."""
    result = yield x
    passed = meets(result, slo)
    out.evaluations.append((x, passed))
    out.results[x] = result
    return passed


def evaluated(steps: Generator[Any, dict[str, Any], SearchResult], evaluate: Callable[[Any], dict[str, Any]]
              ) -> SearchResult:
    """Run a search's steps (search_steps, search_int_steps) to the end, evaluating each point it yields."""
    try:
        x = next(steps)
        while True:
            x = steps.send(evaluate(x))
    except StopIteration as done:
        return done.value


def bracket_step(rel_tol: float) -> float:
    """The largest (1 + rel_tol)^(2^k) up to 2: a bracket that wide is bisected to exactly the tolerance in k tries,
    where doubling brackets (a factor of 2, a sliver wider) take k + 1."""
    step = 1.0 + rel_tol
    while step * step <= 2.0:
        step *= step
    return step


def warm_step(rel_tol: float) -> float:
    """The first bracket factor of a search started at a neighbour's answer (another seed's): one tolerance, so an
    answer that close takes two runs; the factor squares after each try, so a far answer is still reached."""
    return 1.0 + rel_tol


def search(evaluate: Callable[[float], dict[str, Any]], slo: dict[str, float], start: float = 1.0,
           rel_tol: float = 0.02, low_limit: float = 1e-3, high_limit: float = 1e5, step: float | None = None
           ) -> SearchResult:
    """search_steps, evaluating each rate with `evaluate` in turn."""
    return evaluated(search_steps(slo, start, rel_tol, low_limit, high_limit, step), evaluate)


def search_steps(slo: dict[str, float], start: float = 1.0, rel_tol: float = 0.02, low_limit: float = 1e-3,
                 high_limit: float = 1e5, step: float | None = None
                 ) -> Generator[float, dict[str, Any], SearchResult]:
    """Yields each rate to try and takes its result back (send): a caller may evaluate many searches' points
    at once. Bracket from `start` by factors of `step` (default bracket_step(rel_tol); a smaller step, for a
    start near the answer, squares after each try, up to that), then bisect geometrically until
    hi / lo - 1 <= rel_tol. The answer passed at lo and missed at hi, whatever the start."""
    out = SearchResult(0.0)
    most = bracket_step(rel_tol)
    step = most if step is None else step
    most = max(most, step)                        # a wider step asked for (doubling) stays that wide
    lo = hi = start
    if (yield from _judged(start, slo, out)):
        while hi < high_limit:
            lo, hi, step = hi, hi * step, min(step * step, most)
            if not (yield from _judged(hi, slo, out)):
                break
        else:                                     # passed up to the limit
            out.rate = hi
            return out
    else:
        while lo > low_limit:
            hi, lo, step = lo, lo / step, min(step * step, most)
            if (yield from _judged(lo, slo, out)):
                break
        else:
            return out
    while hi / lo - 1 > rel_tol * (1 + 1e-9):       # a bracket exactly one tolerance wide, less rounding, is done
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if (yield from _judged(mid, slo, out)) else (lo, mid)
    out.rate = lo
    return out


def search_int(evaluate: Callable[[int], dict[str, Any]], slo: dict[str, float], start: int = 4,
               high_limit: int = 10**6) -> SearchResult:
    """search_int_steps, evaluating each integer with `evaluate` in turn."""
    return evaluated(search_int_steps(slo, start, high_limit), evaluate)


def search_int_steps(slo: dict[str, float], start: int = 4, high_limit: int = 10**6
                     ) -> Generator[int, dict[str, Any], SearchResult]:
    """The highest integer (e.g. max_concurrency) meeting every target, assuming a larger value never helps:
    bracket by doubling or halving from `start`, then bisect on integers to adjacent pass/fail. 0: 1 fails;
    `high_limit` when it passes there. Yields and takes back points as search_steps."""
    out = SearchResult(0)
    n = max(1, min(int(start), high_limit))
    if (yield from _judged(n, slo, out)):
        lo = n
        while True:
            if lo >= high_limit:
                out.rate = lo
                return out
            hi = min(lo * 2, high_limit)
            if not (yield from _judged(hi, slo, out)):
                break
            lo = hi
    else:
        hi = n
        while True:
            if hi == 1:
                return out
            lo = hi // 2
            if (yield from _judged(lo, slo, out)):
                break
            hi = lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if (yield from _judged(mid, slo, out)) else (lo, mid)
    out.rate = lo
    return out
