"""Client-side latency metrics, defined as `vllm bench serve` defines them, with its result key names.

Per request: TTFT = first streamed token - send; ITL = the gaps between streamed tokens; E2EL = last byte - send;
TPOT = (E2EL - TTFT) / (output tokens - 1), only for requests with more than one output token. Goodput counts
completed requests that meet every given SLO (ms). Shared by the load generator and the simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from kvlab.common.errors import ConfigError

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
VLLM_METRICS, VLLM_PERCENTILES = "ttft,tpot,itl", "99"      # `vllm bench serve`'s defaults


@dataclass(slots=True)
class RequestRecord:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                               # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0                            # e2el, seconds
    start: float = 0.0                              # send time, seconds from the run's start
    error: str = ""
    generated_text: str = ""
    kvlab: dict = field(default_factory=dict)       # the server's per-request KV attribution, when it sends one

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ConfigError(f"bad --goodput {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ConfigError(f"bad --goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not 0 < slos[name] < math.inf:                # NaN fails this too
            raise ConfigError(f"bad --goodput {item!r}: the target must be a finite number of ms > 0")
    return slos


def meets(r: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1000 <= ms for k, ms in slos.items())


def stats(name: str, values_s: list[float] | np.ndarray, percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if len(values_s) else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p, value in zip(percentiles, np.percentile(ms, percentiles).tolist()):   # one partition for them all
        out[f"p{p:g}_{name}_ms"] = value
    return out


def peak_tokens_per_s(records: list[RequestRecord]) -> int:
    """The most tokens streamed to the client within one whole second of the run (vLLM's
    max_output_tokens_per_s): each token at its arrival, counted in the second it fell into."""
    if not records:
        return 0
    # each request's first token time plus the running sum of its gaps: the sums a per-token loop makes, in numpy
    arrivals = np.concatenate([(r.start + r.ttft) + np.cumsum([0.0, *r.itl]) for r in records])
    return int(np.bincount(np.floor(arrivals).astype(int)).max())


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None,
              metrics: tuple[str, ...] = METRICS, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
              max_concurrent: int = 0) -> dict[str, float]:
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    d = max(duration, 1e-9)
    result: dict[str, float] = {
        "duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / d, "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "max_concurrent_requests": max_concurrent,
    }
    result["request_goodput"] = sum(meets(r, slos) for r in ok) / d if slos else None
    result["max_output_tokens_per_s"] = peak_tokens_per_s(ok)
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": np.fromiter(chain.from_iterable(r.itl for r in ok), float, sum(len(r.itl) for r in ok)),
              "e2el": [r.latency for r in ok]}
    for name in metrics:
        if name not in values:
            raise ConfigError(f"unknown percentile metric {name!r}; choose from {', '.join(METRICS)}")
        result.update(stats(name, values[name], percentiles))
    return result
