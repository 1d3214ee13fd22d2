"""Which GEMM the model's Linear layers run (`EngineConfig.linear`): torch's own or oneDNN's, on the CPU.

torch's CPU wheels send an fp32 `F.linear` to MKL's sgemm, and MKL picks its code path by CPU vendor: on an AMD
CPU it runs its AVX2 path even where the CPU has AVX-512. oneDNN, which ships inside torch (`torch.ops.mkldnn`),
picks its path by instruction set. On kvlab's AMD EPYC VM (one thread, SmolLM2-135M's weight shapes) oneDNN is
2.2-2.6x faster from 16 rows up and 1.3x at one row (docs/performance.md "Which GEMM"). Both are IEEE fp32
GEMMs that sum in different orders, so their outputs differ in the last bits, as any two BLAS libraries' do.

`auto`: oneDNN for float32 weights on the CPU when torch has it and a probe agrees with F.linear, else torch's,
with the reason logged. `onednn`: oneDNN or a ConfigError. `torch`: F.linear as is (CUDA always uses it).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.common.errors import ConfigError
from kvlab.common.linear_names import LINEAR_CHOICES

log = logging.getLogger("kvlab.model")


@dataclass(frozen=True, slots=True)
class LinearImpl:
    name: str                                                   # "onednn" or "torch"
    reason: str                                                 # why this one (for `auto`, why not the other)
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]    # (x [..., in], weight [out, in]) -> [..., out]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's inner-product primitive (the op torch's own CPU compiler emits)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


TORCH = LinearImpl("torch", "requested, or a bare model's default", F.linear)


def choose_linear(requested: str, dtype: torch.dtype, device: torch.device | str) -> LinearImpl:
    """The implementation for `requested` (LINEAR_CHOICES) and this model's weights."""
    if requested not in LINEAR_CHOICES:
        raise ConfigError(f"unknown linear {requested!r}; choose one of: {', '.join(LINEAR_CHOICES)}")
    if requested == "torch":
        return TORCH
    device = torch.device(device)
    why_not = onednn_unusable(dtype, device)
    if why_not is None:
        return LinearImpl("onednn", "requested" if requested == "onednn" else "auto: float32 on the CPU",
                          onednn_linear)
    if requested == "onednn":
        raise ConfigError(f"linear onednn is not usable here: {why_not}; use linear auto or torch")
    if dtype == torch.float32 and device.type == "cpu":   # where oneDNN was expected: say why not
        log.warning("linear auto: torch's F.linear, not oneDNN (%s)", why_not)
    return LinearImpl("torch", f"auto: {why_not}", F.linear)


def onednn_unusable(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when oneDNN can run this model's Linear layers, else why not."""
    if device.type != "cpu":
        return f"the model is on {device.type}"
    if dtype != torch.float32:
        return f"{str(dtype).removeprefix('torch.')} weights (torch already uses oneDNN where it helps)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 96, generator=gen), torch.randn(40, 96, generator=gen)
    try:
        got = onednn_linear(x, w)
    except RuntimeError as exc:
        return f"oneDNN's linear failed a probe: {exc}"
    if not torch.allclose(got, F.linear(x, w), rtol=1e-5, atol=1e-4):
        return "oneDNN's linear disagrees with F.linear on a probe"
    return None
