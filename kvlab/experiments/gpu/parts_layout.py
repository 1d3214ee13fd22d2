"""The GPU check's layer_layout part: one decode step's attention (every layer) on vmm's per-layer layout against
its cross-layer layout, both on memory mapped in 2 MiB pages (experiments/gpu/mapped.py), with kvlab's Triton
kernel on the contiguous layout (experiments/gpu/kernel_cases.py). Per-layer: each layer's K (and V) is its own
[slots, row, H_kv, D] region, so a 2 MiB page holds 1,024 tokens of one layer (Llama-3-8B). Cross-layer: one
[slots, row, layers, H_kv, D] region, a token's layers side by side (32 tokens of every layer per page), so a
layer's kernel reads 2 KiB per token at a stride of `layers` x 2 KiB. The time of a step (one CUDA graph of
every layer's call), the two layouts alternated; layer 0's outputs must agree. CPU dry run: host tensors,
the interpreter, two layers."""
from __future__ import annotations

import time
from typing import Any

import torch

from kvlab.experiments.gpu.driver import Driver
from kvlab.experiments.gpu.kernel_cases import LLAMA3_8B_BF16, TINY_FP32, metadata
from kvlab.experiments.gpu.mapped import MappedTensor, mapped
from kvlab.experiments.gpu.parts_kernels import AGREE
from kvlab.experiments.gpu.timing import GraphTimer, paired_seconds, part_deadline

GPU = {"shape": LLAMA3_8B_BF16, "layers": 32, "batch": 16, "row": 8192, "contexts": (2048, 8192), "repeats": 5}
DRY = {"shape": TINY_FP32, "layers": 2, "batch": 2, "row": 32, "contexts": (32,), "repeats": 1}


def part_layer_layout(dry: bool) -> dict[str, Any]:
    from kvlab.experiments.gpu.parts_triton import check_interpreter_setting
    check_interpreter_setting(dry)
    cfg, device = (DRY, "cpu") if dry else (GPU, "cuda")
    d = None if dry else Driver(dry)
    owners: list[MappedTensor] = []
    try:
        layouts = build_layouts(cfg, d, owners)
        fill(cfg, layouts, device)
        rows = compare(cfg, layouts, device)
    finally:
        for owner in owners:
            owner.close()
        if d is not None:
            d.close()
    s = cfg["shape"]
    failed = {"failed": "no context measured within the part's time budget"} \
        if all("not_measured" in row for row in rows) else {}
    return {**failed, "device": device, "memory": "host tensors (dry run)" if dry else "driver-mapped 2 MiB pages",
            "pages_mapped": sum(o.pages for o in owners), "layers": cfg["layers"], "batch": cfg["batch"],
            "row_tokens": cfg["row"], "shape": [s.num_heads, s.num_kv_heads, s.head_dim, s.dtype], "rows": rows}


def build_layouts(cfg: dict[str, Any], d: Driver | None, owners: list[MappedTensor]) -> dict[str, list[tuple]]:
    """{"per_layer": [(K, V) per layer], "cross_layer": [(K, V) views per layer]}: each [batch, row, H_kv, D]."""
    s, layers, batch, row = cfg["shape"], cfg["layers"], cfg["batch"], cfg["row"]
    one = (batch, row, s.num_kv_heads, s.head_dim)
    dt = s.torch_dtype()
    per_layer = [(mapped(d, one, dt, owners), mapped(d, one, dt, owners)) for _ in range(layers)]
    cross_k, cross_v = (mapped(d, (batch, row, layers, s.num_kv_heads, s.head_dim), dt, owners) for _ in "kv")
    return {"per_layer": per_layer, "cross_layer": [(cross_k[:, :, i], cross_v[:, :, i]) for i in range(layers)]}


def fill(cfg: dict[str, Any], layouts: dict[str, list[tuple]], device: str) -> None:
    """The same random K/V in both layouts, layer by layer (memory a fresh page holds may be anything)."""
    g = torch.Generator(device=device).manual_seed(0)
    for (pk, pv), (ck, cv) in zip(layouts["per_layer"], layouts["cross_layer"]):
        for per, cross in ((pk, ck), (pv, cv)):
            src = torch.randn(per.shape, generator=g, device=device).to(per.dtype)
            per.copy_(src)
            cross.copy_(src)


def compare(cfg: dict[str, Any], layouts: dict[str, list[tuple]], device: str) -> list[dict[str, Any]]:
    s, batch, row = cfg["shape"], cfg["batch"], cfg["row"]
    deadline = part_deadline()
    rows = []
    for context in cfg["contexts"]:
        if time.perf_counter() > deadline:
            rows.append({"context": context, "not_measured": "the part's time budget is spent"})
            continue
        g = torch.Generator(device=device).manual_seed(context)
        q = torch.randn(batch, s.num_heads, s.head_dim, generator=g, device=device).to(s.torch_dtype())
        meta = metadata(batch, context, 1, torch.arange(batch, device=device).view(batch, 1), row)

        per, cross = (step_call(q, kv, meta, s.head_dim ** -0.5) for kv in (layouts["per_layer"],
                                                                          layouts["cross_layer"]))
        diff = float((per()[0].float() - cross()[0].float()).abs().max())
        if diff > AGREE[s.dtype]:
            raise AssertionError(f"context {context}: layer 0 differs by {diff:.2e} between the layouts")
        a, b = GraphTimer(device, per, 1), GraphTimer(device, cross, 1)
        per_s, cross_s = paired_seconds(a, b, cfg["repeats"])
        rows.append({"context": context, "per_layer_step_s": per_s, "cross_layer_step_s": cross_s,
                     "cross_over_per_layer": cross_s / per_s, "layer0_max_abs_diff": diff,
                     "fallback": a.fallback or b.fallback})
    return rows


def step_call(q: torch.Tensor, kv: list[tuple], meta: Any, scale: float) -> Any:
    """One decode step's attention: every layer's call, in order."""
    from kvlab.paged.kernels.triton_paged import paged_attention_triton
    return lambda: [paged_attention_triton(q, k, v, meta, scale) for k, v in kv]
