"""kvlab's performance suite (`python -m kvlab.experiments.bench.perf`, or `kvlab bench --suite perf`).

Each module measures one family of ratios in this process, at a fixed torch thread count, with warm-ups and
medians of repeats: `throughput` (engine vs HF transformers), `attention` (decode kernels), `end_to_end`
(vmm vs paged through the LLM API), `allocator` (map/unmap, block pool, allocator share of a run) and
`simulator` (seed simulation wall time, scheduler overhead) and `serving` (`kvlab serve` against offline at
saturation). Speed goals live here, never in unit tests.
"""
