"""latency.peak_tokens_per_s counts each token in the second it arrived: the numpy form counts exactly what a
per-token loop over the same sums counts."""
from __future__ import annotations

import random

import numpy as np

from kvlab.experiments.loadgen.latency import RequestRecord, peak_tokens_per_s


def loop_peak(records: list[RequestRecord]) -> int:
    arrivals = [r.start + r.ttft + t for r in records for t in np.cumsum([0.0, *r.itl])]
    return int(np.bincount(np.floor(arrivals).astype(int)).max()) if arrivals else 0


def test_the_peak_equals_a_per_token_loops():
    rng = random.Random(7)
    for _ in range(20):
        records = []
        for _ in range(rng.randint(1, 40)):
            rec = RequestRecord(success=True, prompt_len=8, output_tokens=1, start=rng.uniform(0, 30))
            rec.ttft = rng.uniform(0.01, 3.0)
            rec.itl = [rng.uniform(0.001, 0.2) for _ in range(rng.randint(0, 300))]
            records.append(rec)
        assert peak_tokens_per_s(records) == loop_peak(records)
    assert peak_tokens_per_s([]) == 0
