"""What a load run's results are made of, with no HTTP client: the request rates' flag, the result row's columns,
each request's log line and the server-attributed totals. The simulator builds the same results from these
(experiments/sim/serve/run.py) without importing the load generator's client."""
from __future__ import annotations

import math
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen import latency

ROW_KEYS = ("backend", "request_rate", "completed", "failed", "duration", "request_throughput",
            "output_throughput", "request_goodput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
            "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms", "max_concurrent_requests", "server_preemptions",
            "total_kv_wait_s", "total_num_preemptions", "total_recomputed_tokens", "total_map_unmap_s")
SWEEP_ROW_KEYS = (*ROW_KEYS[:2], "repeat", *ROW_KEYS[2:])      # simulate serve's CSV shares ROW_KEYS, no repeats
ATTRIBUTED = ("kv_wait_s", "num_preemptions", "recomputed_tokens", "map_unmap_s")


def parse_rates(items: list[str]) -> list[float]:
    try:
        rates = [float(x) for x in items]
    except ValueError:
        raise ConfigError(f"bad --request-rates {','.join(items)}: numbers or inf, e.g. 1,2,4,inf") from None
    if any(not r > 0 for r in rates):
        raise ConfigError("every request rate must be > 0 (or inf)")
    return rates


def request_log(r: latency.RequestRecord) -> dict[str, Any]:
    """One request of the run: client timings plus the server's KV attribution (absent for a non-kvlab server)."""
    return {"start_s": r.start, "ttft_s": r.ttft, "e2el_s": r.latency, "prompt_len": r.prompt_len,
            "output_tokens": r.output_tokens, "success": r.success, "error": r.error} | \
        {k: r.kvlab.get(k) for k in ATTRIBUTED}


def attribution_totals(records: list[latency.RequestRecord]) -> dict[str, float]:
    """Sums over the run's requests of what the server attributed to each (NaN when it reported nothing)."""
    seen = [r.kvlab for r in records if r.kvlab]
    return {f"total_{k}": (sum(e.get(k) or 0 for e in seen) if seen else math.nan) for k in ATTRIBUTED}
