"""Stop a search run as soon as its SLO is certainly missed.

An SLO search only needs pass or fail at each rate, and a run past the knee is as long to simulate as one below
it. A percentile target `pQ_ttft_ms <= X` over N requests is missed once N - floor(Q/100 * (N - 1)) requests are
known to exceed X: numpy's (linear) percentile is at least the order statistic at that index. A request's TTFT is
known to exceed X once its first token comes later than arrival + X, or once the clock passes arrival + X with no
token (its token will come later still). Likewise `pQ_tpot_ms <= Y` over the requests with two or more outputs:
a finished request's TPOT is exact, and an unfinished one's is at least (now - first token) / (outputs - 1).
If a request fails instead, the run fails the SLO anyway (`slo.meets` wants no failure), so stopping is the
right decision in every case. Other keys (mean, e2el, itl) never stop a run early."""
from __future__ import annotations

import heapq
import math
import re
from typing import Any

KEY_RE = re.compile(r"(?:p(\d+(?:\.\d+)?)|median)_(ttft|tpot)_ms")
TPOT_CHECK_EVERY = 32          # steps between scans of the in-flight requests' TPOT lower bounds


class SloMissed(Exception):
    """Raised by the tap when the run can no longer meet its SLO."""

    def __init__(self, key: str, at_s: float) -> None:
        super().__init__(f"{key} certainly missed at t={at_s:.3f} s")
        self.key, self.at_s = key, at_s


def late_needed(n: int, q: float) -> int:
    """How many of n values above a limit put their q-th percentile (numpy's linear rule) above it."""
    return n - math.floor(q / 100 * (n - 1)) if n else 1


def targets(slo: dict[str, float]) -> dict[str, tuple[float, str, float]]:
    """The keys that can stop a run: key -> (percentile, metric, limit in seconds)."""
    out = {}
    for key, limit_ms in slo.items():
        m = KEY_RE.fullmatch(key)
        if m:
            out[key] = (float(m.group(1) or 50.0), m.group(2), limit_ms / 1000)
    return out


class SloWatch:
    """Fed every sampled token's time by the tap; `check(now)` raises SloMissed once a target is lost."""

    def __init__(self, slo: dict[str, float], arrivals: list[float], output_lens: list[int]) -> None:
        self.arrivals = sorted(arrivals)
        multi = sum(1 for n in output_lens if n > 1)
        self.ttft = self.tpot = None
        for key, (q, metric, limit) in targets(slo).items():
            if metric == "ttft" and (self.ttft is None or late_needed(len(arrivals), q) < self.ttft[1]):
                self.ttft = (key, late_needed(len(arrivals), q), limit)
            if metric == "tpot" and (self.tpot is None or late_needed(multi, q) < self.tpot[1]):
                self.tpot = (key, late_needed(multi, q), limit)
        self.passed = 0                       # arrivals whose TTFT deadline has passed
        self.on_time: list[float] = []        # deadlines of requests whose first token came in time (a heap)
        self.on_time_passed = 0
        self.first: dict[str, tuple[float, int]] = {}   # unfinished multi-token requests: first token, outputs
        self.tpot_late = 0
        self.steps = 0

    @property
    def active(self) -> bool:
        return self.ttft is not None or self.tpot is not None

    def on_token(self, request_id: str, count: int, arrival: float, outputs: int, now: float) -> None:
        """The request's `count`-th token (of `outputs`) came at `now`."""
        if count == 1:
            if self.ttft is not None and now - arrival <= self.ttft[2]:
                heapq.heappush(self.on_time, arrival + self.ttft[2])
            if outputs > 1:
                self.first[request_id] = (now, outputs)
        elif count == outputs and request_id in self.first:
            first, _ = self.first.pop(request_id)
            if self.tpot is not None and (now - first) / (outputs - 1) > self.tpot[2]:
                self.tpot_late += 1

    def check(self, now: float) -> None:
        if self.ttft is not None:
            self._check_ttft(now)
        self.steps += 1
        if self.tpot is not None and self.steps % TPOT_CHECK_EVERY == 0:
            self._check_tpot(now)

    def _check_ttft(self, now: float) -> None:
        key, needed, limit = self.ttft
        while self.passed < len(self.arrivals) and self.arrivals[self.passed] + limit < now:
            self.passed += 1
        while self.on_time and self.on_time[0] < now:
            heapq.heappop(self.on_time)
            self.on_time_passed += 1
        if self.passed - self.on_time_passed >= needed:
            raise SloMissed(key, now)

    def _check_tpot(self, now: float) -> None:
        key, needed, limit = self.tpot
        bound = sum(1 for first, outputs in self.first.values() if (now - first) / (outputs - 1) > limit)
        if self.tpot_late + bound >= needed:
            raise SloMissed(key, now)


def stopped_result(missed: SloMissed) -> dict[str, Any]:
    """What a stopped run reports instead of its figures."""
    return {"stopped_early": True, "slo_missed": missed.key, "stopped_at_s": missed.at_s}


__all__ = ["SloMissed", "SloWatch", "late_needed", "stopped_result", "targets"]
