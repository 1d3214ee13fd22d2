"""`kvlab simulate --preset fp8` and `--preset window`: the KV-dtype and sliding-window presets (issue 17).

- fp8: Llama-3-8B on an H100 at 60 GB, the seed workload, every backend (reserve, oracle, paged-16, vmm 2 MiB),
  bf16 KV against fp8_e4m3 KV: batch and throughput gains of fp8 per backend. fp8 halves both the bytes a token
  takes (capacity) and the bytes a decode step reads (roofline).
- window: Mistral-7B (sliding window 4096) against the same model with full attention, prompts 16K-28K and
  outputs 1K-4K (contexts up to 32K), every backend. The window reads at most W keys per query; paged frees
  the blocks and vmm unmaps the pages wholly below it, reserve keeps its whole region.
"""
from __future__ import annotations

import dataclasses

from kvlab.experiments.reporting.tables import fmt, table
from kvlab.experiments.sim.core import SimCase, SimRow, SimSettings, run_cases
from kvlab.experiments.workloads.requests import parse_workload

WATERMARK = 0.05
BUDGET_GB = 60.0
WINDOW_WORKLOAD = "uniform:16384-28672:1024-4096"
WINDOW_REQUESTS = 200
WINDOW_MAX_LEN = 32768
WINDOW_CHANGES = (f"workload changes: none (the window preset's own workload: {WINDOW_REQUESTS} requests, "
                  f"{WINDOW_WORKLOAD}, prompt + output <= {WINDOW_MAX_LEN} as drawn; --seed applies, "
                  "--workload, --num-requests, --rate, --scale and --max-len do not)")


def cases() -> list[SimCase]:
    return [SimCase("reserve", BUDGET_GB), SimCase("oracle", BUDGET_GB),
            SimCase("paged", BUDGET_GB, 16, watermark=WATERMARK),
            SimCase("vmm", BUDGET_GB, page_size=2 * 2**20, watermark=WATERMARK)]


def fp8_variants(settings: SimSettings) -> dict[str, SimSettings]:
    """The run's settings with bf16 KV and with fp8_e4m3 KV (Llama-3-8B unless --model says otherwise)."""
    return {kv: dataclasses.replace(settings, engine={**settings.engine, "kv_cache_dtype": kv})
            for kv in ("auto", "fp8_e4m3")}


def window_variants(settings: SimSettings) -> dict[str, SimSettings]:
    workload = dataclasses.replace(parse_workload(WINDOW_WORKLOAD), num_requests=WINDOW_REQUESTS,
                                   seed=settings.workload.seed, max_len=WINDOW_MAX_LEN)
    return {name: dataclasses.replace(settings, model=name, workload=workload)
            for name in ("mistral-7b-full", "mistral-7b")}


def run_pair(variants: dict[str, SimSettings], jobs: int, progress: bool) -> dict[str, list[SimRow]]:
    return {name: run_cases(cases(), s, jobs, progress) for name, s in variants.items()}


def report(title: str, rows: dict[str, list[SimRow]]) -> str:
    """Per backend: batch and throughput of the baseline and the variant, and their ratios."""
    (base_name, base), (new_name, new) = rows.items()
    body = [[b.label, fmt(b.mean_batch), fmt(n.mean_batch), f"{n.mean_batch / b.mean_batch:.2f}x",
             fmt(b.output_tokens_per_s), fmt(n.output_tokens_per_s),
             f"{n.output_tokens_per_s / b.output_tokens_per_s:.2f}x", str(b.preemptions), str(n.preemptions)]
            for b, n in zip(base, new)]
    head = ["backend", f"batch {base_name}", f"batch {new_name}", "batch gain", f"tok/s {base_name}",
            f"tok/s {new_name}", "tput gain", f"preempt {base_name}", f"preempt {new_name}"]
    return f"{title}\n{table(head, body)}"
