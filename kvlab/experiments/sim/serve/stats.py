"""Spread over seeds and paired bootstrap intervals of ratios (numpy; resampling seeds with replacement)."""
from __future__ import annotations

import numpy as np

BOOTSTRAP_SAMPLES = 4000


def spread(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            "min": float(a.min()), "max": float(a.max()), "n": len(a)}


def bootstrap_mean(values: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    a = np.asarray(values, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(a), (BOOTSTRAP_SAMPLES, len(a)))
    means = a[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(a.mean()), float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def bootstrap_ratio(num: list[float], den: list[float], level: float = 0.95,
                    seed: int = 0) -> tuple[float, float, float]:
    """mean(num) / mean(den) and its percentile interval, resampling the paired seeds together."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    idx = np.random.default_rng(seed).integers(0, len(a), (BOOTSTRAP_SAMPLES, len(a)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a[idx].mean(axis=1) / b[idx].mean(axis=1)
        point = a.mean() / b.mean()
    ratios = ratios[np.isfinite(ratios)]
    if not len(ratios):
        return float(point), float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    return float(point), float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))
