"""Phase-shifted on/off arrivals for N models, the shape of the real multi-model bench: every period is cut into N
phases, and model i bursts during the first `duty` of phase i of each period and sends at `idle_share` of its
burst rate the rest of the time. The burst rate is set so that all models together send `total_rate` requests/s
on average: each model's mean is total_rate / N = burst x (duty / N + idle_share x (1 - duty / N)).

Gaps inside a window are `vllm bench serve`'s gamma gaps (loadgen/arrivals.py), from a generator seeded by
(seed, model): every arrangement of an A/B sees the same arrivals."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlab.experiments.loadgen.arrivals import intervals


@dataclass(frozen=True, slots=True)
class OnOff:
    models: int
    period_s: float = 60.0
    periods: int = 2
    duty: float = 1.0               # fraction of its phase a model bursts, in (0, 1]
    idle_share: float = 0.0         # a model's rate outside its burst, as a fraction of its burst rate
    burstiness: float = 1.0         # gamma shape of the gaps (1 = Poisson)

    @property
    def duration_s(self) -> float:
        return self.period_s * self.periods

    def burst_rate(self, total_rate: float) -> float:
        on = self.duty / self.models
        return total_rate / self.models / (on + self.idle_share * (1 - on))

    def windows(self, model: int, total_rate: float) -> list[tuple[float, float, float]]:
        """(start, end, rate) covering [0, duration) for `model`."""
        phase, burst = self.period_s / self.models, self.burst_rate(total_rate)
        out, t = [], 0.0
        for k in range(self.periods):
            start = k * self.period_s + model * phase
            out += [(t, start, burst * self.idle_share), (start, start + self.duty * phase, burst)]
            t = start + self.duty * phase
        return [w for w in [*out, (t, self.duration_s, burst * self.idle_share)] if w[1] > w[0] and w[2] > 0]

    def arrivals(self, model: int, total_rate: float, seed: int) -> list[float]:
        rng = np.random.default_rng([seed, model])
        times: list[float] = []
        for start, end, rate in self.windows(model, total_rate):
            times += window_times(start, end, rate, self.burstiness, rng)
        return times


def window_times(start: float, end: float, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival times in [start, end) with gamma gaps of mean 1/rate."""
    out, t = [], start
    while True:
        for gap in intervals(max(16, int((end - t) * rate * 1.1)), rate, burstiness, rng):
            t += float(gap)
            if t >= end:
                return out
            out.append(t)
