"""The GPU check's kernel_costs part: the kernel term's measurement (bench/kernel_costs.py) on the GPU in fp16,
Llama-3-8B's per-layer head shape; its result holds the kernel profile that `kvlab simulate --kernel-costs
measured:gpu_check.json` reads. The CPU dry run measures one tiny point per phase (plumbing, not a speed)."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.bench.kernel_costs import Grid, measure_profile

# sized for its 45 s: the inputs are drawn on the host (kernel_inputs.py), ~0.1 s per 10M values
GPU_GRID = Grid(dtype="float16", batch=8, decode_contexts=(1024, 4096, 8192), prefill_contexts=(512, 2048),
                block_sizes=(16, 32, 128), repeats=10)
DRY_GRID = Grid(num_heads=4, num_kv_heads=2, head_dim=64, batch=2, decode_contexts=(64,), prefill_contexts=(32,),
                block_sizes=(16,), repeats=2)


def part_kernel_costs(dry: bool) -> dict[str, Any]:
    import torch
    device = "cpu" if dry else "cuda"
    grid = DRY_GRID if dry else GPU_GRID
    name = torch.cuda.get_device_name() if not dry else "cpu dry run"
    profile = measure_profile(grid, device, "measured", f"GPU check kernel_costs on {name}, {grid.dtype}")
    return {"device": device, "gpu": name, "profile": profile}
