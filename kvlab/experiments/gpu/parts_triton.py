"""The GPU check's Triton parts: the paged Triton kernel against SDPA (max error, first-call compile time,
per-call time), compiled on the GPU, in the interpreter on tiny shapes in the CPU dry run. triton_vs_sdpa runs
the check's shapes and times the torch gather and contiguous SDPA beside it; triton_kernel is first contact's
three cases, Triton alone."""
from __future__ import annotations

import os
from typing import Any

from kvlab.experiments.gpu.parts_engine import TOLERANCE
from kvlab.experiments.gpu.timing import device_timer, timed_call

LLAMA3_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}     # per layer


def dry_cases() -> list[dict[str, Any]]:
    tiny = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "dtype": "float32"}
    return [{**tiny, "phase": "decode", "query_lens": [1, 1], "context_lens": [40, 64]},
            {**tiny, "phase": "prefill", "query_lens": [5], "context_lens": [37]}]


def check_cases() -> list[dict[str, Any]]:
    out = [{**LLAMA3_8B, "dtype": dt, "phase": "decode", "query_lens": [1] * 16, "context_lens": [ctx] * 16}
           for dt in ("float16", "bfloat16") for ctx in (1024, 8192)]
    out.append({**LLAMA3_8B, "dtype": "float16", "phase": "decode", "query_lens": [1] * 16,
                "context_lens": list(range(4096, 8192, 256))})
    out.append({**LLAMA3_8B, "dtype": "bfloat16", "phase": "mixed", "query_lens": [64, 1, 200],
                "context_lens": [512, 3000, 1000]})
    return out


def first_contact_cases() -> list[dict[str, Any]]:
    return [{**LLAMA3_8B, "dtype": "float16", "phase": "decode", "query_lens": [1] * 16, "context_lens": [4096] * 16},
            {**LLAMA3_8B, "dtype": "float16", "phase": "prefill", "query_lens": [512, 1, 200],
             "context_lens": [512, 3000, 1000]},
            {**LLAMA3_8B, "dtype": "bfloat16", "phase": "decode", "query_lens": [1] * 16, "context_lens": [4096] * 16}]


def part_triton_vs_sdpa(dry: bool) -> dict[str, Any]:
    return triton_part(dry_cases() if dry else check_cases(), dry, compare=True)


def part_triton_kernel(dry: bool) -> dict[str, Any]:
    return triton_part(dry_cases() if dry else first_contact_cases(), dry, compare=False)


def triton_part(cases: list[dict[str, Any]], dry: bool, compare: bool) -> dict[str, Any]:
    import torch
    check_interpreter_setting(dry)
    device = "cpu" if dry else "cuda"
    rows = []
    for case in cases:
        try:
            rows.append(triton_row(case, device, compare))
        except Exception as exc:  # noqa: BLE001 - keep the other shapes
            rows.append({**case, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        if device == "cuda":
            torch.cuda.empty_cache()
    out = {"device": device, "mode": "interpreter, tiny shapes" if dry else "compiled", "configs": rows}
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        out["failed"] = f"{len(bad)} of {len(rows)} Triton configurations failed or exceeded the tolerance"
    return out


def check_interpreter_setting(dry: bool) -> None:
    """The interpreter on CPU, set before Triton is imported; the compiled kernel on a GPU."""
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the CPU dry run needs TRITON_INTERPRET=1 before Triton is imported")
    if not dry and os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 on a GPU run: unset it (triton 3.6 + numpy 2.5 break the "
                           "interpreter; this part checks the compiled kernel)")


def triton_row(cfg: dict[str, Any], device: str, compare: bool) -> dict[str, Any]:
    import torch

    from kvlab.experiments.bench.perf.kernel_inputs import paged_case, reference
    from kvlab.paged.kernels.triton_paged import paged_attention_triton
    case = paged_case(cfg["query_lens"], cfg["context_lens"], cfg["block_size"], cfg["num_heads"],
                      cfg["num_kv_heads"], cfg["head_dim"], getattr(torch, cfg["dtype"]), device)
    run = lambda: paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    first = timed_call(run, device)                      # includes the compile on a GPU
    err = float((run().float() - reference(case)).abs().max())
    row = {**{k: v for k, v in cfg.items() if k not in ("query_lens", "context_lens")},
           "batch": len(cfg["query_lens"]), "max_query_len": max(cfg["query_lens"]),
           "max_context": max(cfg["context_lens"]), "max_abs_err": err, "ok": err <= TOLERANCE[cfg["dtype"]],
           "first_call_s": first}
    row["triton_ms"] = device_timer(device, run, 3 if device == "cpu" or not compare else 20)
    row["compile_s"] = max(first - row["triton_ms"]["median"] / 1e3, 0.0)
    if compare:
        row.update(comparisons(case, cfg, device))
    return row


def comparisons(case: Any, cfg: dict[str, Any], device: str) -> dict[str, Any]:
    """The torch gather over the same pages, and SDPA on the contiguous layout where the batch is uniform."""
    import torch.nn.functional as F

    from kvlab.experiments.bench.perf.kernel_inputs import dense_decode_inputs
    from kvlab.paged.kernels.torch_ref import paged_attention_torch
    repeats = 3 if device == "cpu" else 20
    out = {"torch_paged_gather_ms": device_timer(device, lambda: paged_attention_torch(
        case.q, case.k_cache, case.v_cache, case.meta, case.scale), repeats)}
    if case.meta.is_decode and len(set(cfg["context_lens"])) == 1:
        q, k, v = dense_decode_inputs(case)
        out["sdpa_contiguous_ms"] = device_timer(device, lambda: F.scaled_dot_product_attention(
            q, k, v, scale=case.scale, enable_gqa=True), repeats)
    return out
