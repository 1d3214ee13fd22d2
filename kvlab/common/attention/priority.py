"""The per-device order `kernel="auto"` follows: the first kernel whose rules accept the spec runs, the others
that accept it stay behind it as run-time fallbacks, in this order.

- cuda, paged: flash_attn_paged, flashinfer_paged, triton_paged, flex_paged, torch_paged (vLLM's order for
  cc 8.x-9.x, then kvlab's gather reference).
- cuda, contiguous: flash_attn_contiguous, torch_sdpa_contiguous.
- cpu, paged: torch_paged, then triton_paged (interpreter only). cpu, contiguous: torch_sdpa_contiguous.
"""
from __future__ import annotations

from kvlab.common.attention.spec import base_device
from kvlab.common.errors import KernelUnavailable

PRIORITY: dict[tuple[str, str], tuple[str, ...]] = {
    ("cuda", "paged"): ("flash_attn_paged", "flashinfer_paged", "triton_paged", "flex_paged", "torch_paged"),
    ("cuda", "contiguous"): ("flash_attn_contiguous", "torch_sdpa_contiguous"),
    ("cpu", "paged"): ("torch_paged", "triton_paged"),
    ("cpu", "contiguous"): ("torch_sdpa_contiguous",),
}


def priority(device: str, layout: str) -> list[str]:
    try:
        return list(PRIORITY[(base_device(device), layout)])
    except KeyError:
        raise KernelUnavailable(f"no attention kernels for device {device!r} and layout {layout!r}; "
                                "use device cpu or cuda") from None
