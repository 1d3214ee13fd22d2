"""Seeds folded into figures with their spread, and backend ratios with paired bootstrap 95% intervals."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.serve.grid import grouped
from kvlab.experiments.sim.serve.stats import bootstrap_mean, bootstrap_ratio, spread

FIGURES = ("output_throughput", "request_throughput", "request_goodput", "p50_ttft_ms", "p99_ttft_ms",
           "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "max_concurrent_requests",
           "server_preemptions")
RATIO_FIGURES = ("output_throughput", "p99_ttft_ms", "p99_tpot_ms", "request_goodput")


def by_seed(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in sorted(rows, key=lambda r: r["seed"]) if r.get(key) is not None]


def fold(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (backend, rate): every figure's spread over seeds."""
    out = []
    for (backend, rate), mine in grouped(rows, "backend", "request_rate").items():
        entry: dict[str, Any] = {"backend": backend, "request_rate": rate, "seeds": len(mine)}
        for key in FIGURES:
            values = by_seed(mine, key)
            if values:
                entry[key] = spread(values)
        out.append(entry)
    return out


def ratios(rows: list[dict[str, Any]], reference: str) -> list[dict[str, Any]]:
    """backend / reference per rate and figure, paired by seed."""
    out = []
    groups = grouped(rows, "backend", "request_rate")
    for (backend, rate), mine in groups.items():
        ref = groups.get((reference, rate))
        if backend == reference or ref is None:
            continue
        for key in RATIO_FIGURES:
            a, b = by_seed(mine, key), by_seed(ref, key)
            if a and len(a) == len(b):
                point, lo, hi = bootstrap_ratio(a, b)
                out.append({"backend": backend, "reference": reference, "request_rate": rate, "figure": key,
                            "ratio": point, "ci95": [lo, hi]})
    return out


def slo_summary(rates: dict[str, list[float]], reference: str, key: str = "slo_rate") -> dict[str, Any]:
    """rates: backend -> the searched value per seed (same seed order for every backend), reported as `key`
    (slo_rate, or slo_max_concurrency for the concurrency search)."""
    per = {}
    for backend, values in rates.items():
        mean, lo, hi = bootstrap_mean(values)
        per[backend] = {key: mean, "ci95": [lo, hi], "per_seed": values, **{"spread": spread(values)}}
    rel = {}
    for backend, values in rates.items():
        if backend != reference:
            point, lo, hi = bootstrap_ratio(values, rates[reference])
            rel[backend] = {"reference": reference, "ratio": point, "ci95": [lo, hi]}
    return {"backends": per, "ratios": rel}
