"""Phase-shifted on/off load for several models: each period is cut into one phase per model, and model i bursts
at the burst rate during the first `duty` fraction of phase i of every period and sends at the idle rate (0 by
default) the rest of the time. With duty 1 the bursts tile the period: exactly one model is busy at any moment.

Arrivals inside each constant-rate window are `vllm bench serve`'s gamma gaps (arrivals.py), drawn from a
generator seeded by (seed, model), so every configuration of an A/B gets the same arrivals."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvlab.experiments.loadgen.arrivals import intervals


@dataclass(frozen=True, slots=True)
class Phases:
    models: int
    period_s: float
    duty: float                 # fraction of a model's phase it bursts, in (0, 1]
    burst_rate: float           # requests/s of a model while it bursts
    idle_rate: float = 0.0      # requests/s of a model outside its burst
    periods: int = 1
    burstiness: float = 1.0     # gamma shape of the gaps (1 = Poisson)

    @property
    def phase_s(self) -> float:
        return self.period_s / self.models

    @property
    def duration_s(self) -> float:
        return self.period_s * self.periods

    def bursts(self, model: int) -> list[tuple[float, float]]:
        """(start, end) of each of model's bursts, in seconds from the run's start."""
        start, length = model * self.phase_s, self.duty * self.phase_s
        return [(k * self.period_s + start, k * self.period_s + start + length) for k in range(self.periods)]

    def windows(self, model: int) -> list[tuple[float, float, float]]:
        """(start, end, rate): model's whole schedule over [0, duration) as constant-rate windows, in order."""
        edges, out, t = self.bursts(model), [], 0.0
        for start, end in edges:
            out += [(t, start, self.idle_rate)] if start > t else []
            out.append((start, end, self.burst_rate))
            t = end
        out += [(t, self.duration_s, self.idle_rate)] if self.duration_s > t else []
        return out

    def arrivals(self, model: int, seed: int = 0) -> list[float]:
        """model's arrival times in seconds from the run's start, increasing, all before the run's end."""
        rng = np.random.default_rng([seed, model])
        times: list[float] = []
        for start, end, rate in self.windows(model):
            times += window_arrivals(start, end, rate, self.burstiness, rng)
        return times


def window_arrivals(start: float, end: float, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Gamma-gap arrivals in [start, end) at `rate` (none at rate 0); drawn in chunks of the expected count."""
    if rate <= 0 or end <= start:
        return []
    times, t = [], start
    chunk = max(8, math.ceil((end - start) * rate * 1.2))
    while True:
        for gap in intervals(chunk, rate, burstiness, rng):
            t += float(gap)
            if t >= end:
                return times
            times.append(t)


def burst_of(phases: Phases, t: float) -> int | None:
    """The model bursting at time t (None between bursts); bursts never overlap."""
    model = int((t % phases.period_s) // phases.phase_s)
    start = (t // phases.period_s) * phases.period_s + model * phases.phase_s
    return model if model < phases.models and t - start < phases.duty * phases.phase_s else None
