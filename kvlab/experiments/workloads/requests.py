"""Workloads: request lengths and arrival times, seeded, from the seed article's distribution, fixed or
uniform lengths, or a JSONL trace. A request becomes a sequence that ignores EOS and stops at output_len."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN, check_seed
from kvlab.common.validate import as_finite, check_int, check_number, shown
from kvlab.experiments.limits import MAX_REQUESTS, MAX_SPAN_S
from kvlab.experiments.workloads.jsonl import TraceLine, request_lines

Z95 = 1.6448536269514722          # standard normal 95th percentile
SEED_MAX_LEN = 4096               # the article's maximum total length (prompt + output)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """exp(N(mu, sigma^2)); built from the summary statistics the article reports."""
    mu: float
    sigma: float

    @classmethod
    def from_median_p95(cls, median: float, p95: float) -> LogNormal:
        if not 0 < median < p95:
            raise ConfigError(f"log-normal needs 0 < median < p95, got median {median}, p95 {p95}")
        return cls(math.log(median), (math.log(p95) - math.log(median)) / Z95)

    @classmethod
    def from_mean_p95(cls, mean: float, p95: float) -> LogNormal:
        """mean = exp(mu + s^2/2) and p95 = exp(mu + z s) give s^2/2 - z s + ln(p95/mean) = 0; the smaller
        root is the one whose median lies below the mean by a plausible amount."""
        gap = math.log(p95 / mean) if mean > 0 and p95 > 0 else -1.0
        if gap <= 0 or gap > Z95 * Z95 / 2:
            raise ConfigError(f"no log-normal has mean {mean} and p95 {p95} (need mean < p95 < mean*e^{Z95**2/2:.2f})")
        sigma = Z95 - math.sqrt(Z95 * Z95 - 2 * gap)
        return cls(math.log(mean) - sigma * sigma / 2, sigma)

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma ** 2 / 2)

    def quantile(self, z: float) -> float:
        return math.exp(self.mu + z * self.sigma)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.lognormal(self.mu, self.sigma, n)


SEED_PROMPTS = LogNormal.from_median_p95(584, 2155)
SEED_OUTPUTS = LogNormal.from_mean_p95(374, 1118)


@dataclass(slots=True)
class Request:
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    token_ids: list[int] | None = None   # the prompt's tokens when its content matters (prefix caching)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len

    def to_json(self) -> dict:
        return {"prompt_len": self.prompt_len, "output_len": self.output_len, "arrival_s": self.arrival_s}


@dataclass(slots=True)
class WorkloadSpec:
    """What to generate. kind: seed | fixed | uniform | trace. `scale` shrinks every length (and max_len)
    for CPU-sized runs; `rate` > 0 gives Poisson arrivals at that many requests per second, else all at 0."""
    kind: str = "seed"
    num_requests: int = 2000
    seed: int = 0
    scale: float = 1.0
    max_len: int = SEED_MAX_LEN
    prompt_len: int | tuple[int, int] = 128      # fixed length, or (low, high) inclusive for uniform
    output_len: int | tuple[int, int] = 128
    trace: str | None = None
    rate: float = 0.0


def clip_lengths(prompts: np.ndarray, outputs: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Round to whole tokens, at least 1 each, prompt + output <= max_len. The prompt is cut, the output kept
    (up to max_len - 1): long outputs drive preemption, and this is the cap that reproduces the seed article's
    preemption counts and total output tokens (docs/experiments.md)."""
    if max_len < 2:
        raise ConfigError(f"max_len must be >= 2 (one prompt and one output token), got {max_len}")
    o = np.clip(np.rint(outputs), 1, max_len - 1).astype(np.int64)
    p = np.maximum(np.rint(prompts), 1).astype(np.int64)
    return np.minimum(p, max_len - o), o


def seed_lengths(rng: np.random.Generator, n: int, max_len: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    prompts = SEED_PROMPTS.sample(rng, n) * scale
    outputs = SEED_OUTPUTS.sample(rng, n) * scale
    return clip_lengths(prompts, outputs, scaled(max_len, scale))


def scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def as_range(value: int | tuple[int, int], name: str) -> tuple[int, int]:
    low, high = (value, value) if isinstance(value, int) else value
    if not 1 <= low <= high:
        raise ConfigError(f"{name} range must satisfy 1 <= low <= high, got {low}-{high}")
    return low, high


def uniform_lengths(rng: np.random.Generator, spec: WorkloadSpec) -> tuple[np.ndarray, np.ndarray]:
    (pl, ph), (ol, oh) = as_range(spec.prompt_len, "prompt_len"), as_range(spec.output_len, "output_len")
    p = rng.integers(pl, ph + 1, spec.num_requests) * spec.scale
    o = rng.integers(ol, oh + 1, spec.num_requests) * spec.scale
    return clip_lengths(p, o, scaled(spec.max_len, spec.scale))


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times (seconds) of a Poisson process with `rate` requests/s; all zero when rate <= 0."""
    if rate <= 0:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, n))


def checked_spec(spec: WorkloadSpec) -> WorkloadSpec:
    """Every number of a workload finite and bounded before anything is drawn or allocated (a NaN or tiny rate
    would put arrivals at NaN or years away, a run that never ends; a huge scale or count exhausts RAM); the
    spec returned holds them as the types they are used as."""
    if as_finite(spec.scale) is None or not spec.scale > 0:
        raise ConfigError(f"length scale must be positive, got {shown(spec.scale)}")
    if spec.scale > MAX_MODEL_LEN:
        raise ConfigError(f"length scale {spec.scale:g} is more than {MAX_MODEL_LEN:,}: every request would exceed "
                          "the maximum length; lower --scale")
    spec = replace(spec, num_requests=check_int("num_requests", spec.num_requests, 1, MAX_REQUESTS),
                   seed=check_seed("seed", spec.seed), scale=float(spec.scale),
                   max_len=check_int("max_len", spec.max_len, 1, 2**63 - 1),
                   rate=check_number("rate (requests per second)", spec.rate))
    if spec.rate > 0 and spec.num_requests / spec.rate > MAX_SPAN_S:
        raise ConfigError(f"rate {spec.rate:g}/s spreads {spec.num_requests} requests over ~"
                          f"{spec.num_requests / spec.rate:.3g} s, more than the maximum {MAX_SPAN_S:g} s (a week); "
                          "raise --rate (0 = all at once)")
    return spec


def build_workload(spec: WorkloadSpec) -> list[Request]:
    spec = checked_spec(spec)
    if spec.kind == "trace":
        return load_trace(spec.trace, spec.num_requests, spec.scale)
    rng = np.random.default_rng(spec.seed)
    if spec.kind == "seed":
        p, o = seed_lengths(rng, spec.num_requests, spec.max_len, spec.scale)
    elif spec.kind in ("fixed", "uniform"):
        p, o = uniform_lengths(rng, spec)
    else:
        raise ConfigError(f"unknown workload kind {spec.kind!r}; choose seed, fixed, uniform or trace")
    longest = int((p + o).max())
    if longest > MAX_MODEL_LEN:
        raise ConfigError(f"scale {spec.scale:g} gives requests of {longest:,} tokens, more than the maximum "
                          f"{MAX_MODEL_LEN:,}; lower --scale or --max-len")
    arrivals = poisson_arrivals(rng, spec.num_requests, spec.rate)
    return [Request(int(a), int(b), float(t)) for a, b, t in zip(p, o, arrivals)]


def parse_workload(text: str) -> WorkloadSpec:
    """CLI form: `seed`, `fixed:PROMPT:OUTPUT`, `uniform:PLO-PHI:OLO-OHI`, or `trace:PATH.jsonl`."""
    kind, _, rest = text.partition(":")
    try:
        if kind == "seed" and not rest:
            return WorkloadSpec(kind="seed")
        if kind == "trace" and rest:
            return WorkloadSpec(kind="trace", trace=rest)
        if kind in ("fixed", "uniform"):
            prompt, output = rest.split(":")
            parse = int if kind == "fixed" else parse_range
            return WorkloadSpec(kind=kind, prompt_len=parse(prompt), output_len=parse(output))
    except ValueError:
        pass
    raise ConfigError(f"bad workload {text!r}; use seed, fixed:P:O, uniform:PLO-PHI:OLO-OHI or trace:FILE.jsonl")


def parse_range(text: str) -> tuple[int, int]:
    low, high = text.split("-")
    return int(low), int(high)


TRACE_KEYS = ("prompt_len", "output_len", "arrival_s")
TRACE_SCHEMA = "{prompt_len, output_len[, arrival_s]}"


def load_trace(path: str | Path | None, limit: int | None = None, scale: float = 1.0) -> list[Request]:
    """JSONL, one {"prompt_len", "output_len"[, "arrival_s"]} per line; `limit` keeps the first requests.
    Every field passes the validation layer (experiments/workloads/jsonl.py): a bad line is one ConfigError."""
    scale = check_number("length scale", scale, 0.0, MAX_MODEL_LEN, strict=True)
    return [trace_request(line, scale) for line in request_lines(path, TRACE_SCHEMA, limit)]


def trace_request(line: TraceLine, scale: float) -> Request:
    line.only(TRACE_KEYS)
    prompt, output = line.lengths("prompt_len", "output_len", high=MAX_MODEL_LEN)
    arrival = line.number("arrival_s", MAX_SPAN_S, unit=" s", default=0.0)
    p, o = scaled(prompt, scale), scaled(output, scale)
    check_int(f"{line.where}: scaled prompt_len + output_len", p + o, 2, MAX_MODEL_LEN, " (tokens per sequence)")
    return Request(p, o, arrival)


def save_trace(path: str | Path, requests: list[Request]) -> None:
    Path(path).write_text("".join(json.dumps(r.to_json()) + "\n" for r in requests))


def prompt_token_ids(requests: list[Request], vocab_size: int, seed: int, low: int = 3) -> list[list[int]]:
    """Random prompt tokens in [low, vocab_size), seeded; ids below `low` (pad/bos/eos) are avoided."""
    if vocab_size <= low:
        raise ConfigError(f"vocab_size {vocab_size} leaves no ordinary token ids above {low}")
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab_size, r.prompt_len).tolist() for r in requests]


def summarize(requests: list[Request]) -> dict[str, float]:
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    return {"requests": len(requests), "prompt_median": float(np.median(p)),
            "prompt_p95": float(np.percentile(p, 95)), "output_mean": float(o.mean()),
            "output_p95": float(np.percentile(o, 95)), "output_tokens": int(o.sum())}
