"""Request arrival times, as `vllm bench serve` draws them: gamma-distributed gaps with shape `burstiness` and
mean 1/rate (burstiness 1 is Poisson; below 1 burstier, above 1 more regular; CV = 1/sqrt(burstiness)).
A rate of inf sends everything at t = 0. Shared by the load generator and the simulator."""
from __future__ import annotations

import math

import numpy as np

from kvlab.common.errors import ConfigError


def intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n gaps in seconds (the first request waits one gap, as vLLM's generator)."""
    if not rate > 0:
        raise ConfigError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ConfigError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Offsets from the start of the run, non-decreasing; identical for identical arguments."""
    return np.cumsum(intervals(n, rate, burstiness, np.random.default_rng(seed)))
