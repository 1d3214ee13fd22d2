"""What every benchmark shares: timing (warm-ups, medians and p90 of repeats), goals, result rows, the machine."""
from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

COMPARE = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


@dataclass(slots=True)
class Timing:
    """Seconds per call over `repeats` timed samples (after the warm-ups)."""
    median: float
    p90: float
    repeats: int
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        if not samples:
            raise ValueError("a timing needs at least one sample")
        return cls(float(np.median(samples)), float(np.percentile(samples, 90)), len(samples), list(samples))


def measure(fn: Callable[[], Any], repeats: int, warmup: int = 1, inner: int = 1) -> Timing:
    """Call fn `warmup` times untimed, then `repeats` samples of `inner` calls each (seconds per call)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return Timing.of(samples)


def interleaved(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, Timing]:
    """Run each fn once per round, round after round (A B A B ...), so load drift on a shared machine hits
    every contender alike. Each fn returns its own measured seconds (it may exclude its set-up)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(fn())
    return {name: Timing.of(s) for name, s in samples.items()}


def interleaved_llms(make: Callable[[str], tuple[Any, Callable[[], float]]], backends: tuple[str, ...],
                     repeats: int, others: dict[str, Callable[[], float]] | None = None) -> dict[str, Timing]:
    """One LLM per backend, each with its timed run, from `make(backend)`; the runs (after `others`, e.g. a
    baseline) timed `interleaved`; every LLM built is closed, also when building or a run fails."""
    llms, fns = [], dict(others or {})
    try:
        for backend in backends:
            llm, fns[backend] = make(backend)
            llms.append(llm)
        return interleaved(fns, repeats)
    finally:
        for llm in llms:
            llm.close()


@dataclass(frozen=True, slots=True)
class Goal:
    op: str          # one of COMPARE
    target: float

    def met(self, value: float | None) -> bool | None:
        return None if value is None else bool(COMPARE[self.op](value, self.target))

    def __str__(self) -> str:
        return f"{self.op} {self.target:g}"


@dataclass(slots=True)
class Result:
    """One row of the report: a measured value, its unit, and the goal it is held to (if any)."""
    family: str
    name: str
    value: float | None
    unit: str
    goal: Goal | None = None
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        return self.goal.met(self.value) if self.goal is not None else None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["goal"] = str(self.goal) if self.goal is not None else None
        out["met"] = self.met
        return out


@dataclass(frozen=True, slots=True)
class Settings:
    """`quick`: the smallest sizes that still exercise every code path (smoke tests), not measurements."""
    threads: int = 1
    repeats: int = 5
    quick: bool = False
    seed: int = 0


def timing_detail(t: Timing) -> dict[str, Any]:
    return {"median_s": t.median, "p90_s": t.p90, "repeats": t.repeats, "samples_s": t.samples}


def paired_ratios(numerator: Timing, denominator: Timing) -> dict[str, Any]:
    """Per-repeat ratios of two interleaved timings (round i against round i), for the report's spread and
    its count of repeats that met the goal."""
    pairs = zip(numerator.samples, denominator.samples)
    return {"per_repeat": [n / d for n, d in pairs if n > 0 and d > 0]}


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def tiny_kv_bytes_per_token() -> int:
    """KV bytes per token of the `tiny` preset in fp32 (K and V, every layer)."""
    from kvlab.common.presets import TINY_CONFIG as c
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def machine_info() -> dict[str, Any]:
    """The machine and software measured: what every results file records (reporting/provenance.py), plus the
    packages the suite's kernels depend on and the load average at the start."""
    from kvlab.experiments.reporting.provenance import provenance
    record = provenance({})
    info = record["machine"]
    info.update(load_average_at_start=info.pop("load_average"), torch=record["torch"],
                kvlab=record["kvlab"]["version"], source=record["kvlab"]["commit"])
    for package in ("transformers", "triton", "numpy"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = None
    return info
