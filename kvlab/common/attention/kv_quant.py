"""FP8 KV cache: quantise on write, dequantise in the kernels.

K/V are stored as 1-byte fp8 values (e4m3 or e5m2) in uint8 tensors: CPU torch has no fp8 index_copy_, and every
backend's byte arithmetic (views, pages, swaps) stays dtype-free. One scale per layer for K and one for V
(per tensor, like vLLM's k_scale/v_scale): stored = fp8(x / scale), read = float(stored) * scale. The scale is
given in config (`kv_cache_scale`) or computed from the first write of each layer (the first prefill chunk) as
amax * HEADROOM / fp8_max; later values beyond the range saturate (clamped, never inf/NaN).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

# first-prefill amax times this maps to the fp8 maximum: later tokens may be up to 4x larger before they
# saturate. Floating-point formats keep their relative precision under a scale, so this costs only range at the
# small end (e4m3 subnormals start at 2^-6 of the scale, far below attention's significant values).
HEADROOM = 4.0


def encode(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """x / scale as fp8 bytes (uint8), saturated to the format's range."""
    limit = torch.finfo(fp8).max
    return (x.float() / scale).clamp_(-limit, limit).to(fp8).view(torch.uint8)


@functools.cache
def fp8_values(fp8: torch.dtype) -> torch.Tensor:
    """The 256 values an fp8 byte can hold, in fp32 (a constant of the format)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).to(torch.float32)


def decode(raw: torch.Tensor, fp8: torch.dtype, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 bytes (uint8) -> float(fp8) * scale in `dtype` (a new tensor), bit-identical to converting each value.
    A 256-entry table lookup: on CPU, index_select runs ~3x faster than torch's fp8 -> fp32 conversion."""
    table = (fp8_values(fp8).to(raw.device) * scale).to(dtype)
    return table.index_select(0, raw.reshape(-1).to(torch.int32)).view(raw.shape)


@dataclass(slots=True)
class KVQuant:
    """The per-layer scales of one cache and the write-side conversion. `scales[layer] = [k_scale, v_scale]`,
    0.0 until the layer's first write when no scale is given."""
    fp8: torch.dtype
    num_layers: int
    given: float = 0.0
    scales: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scales = [[self.given, self.given] for _ in range(self.num_layers)]

    def _scale(self, layer: int, which: int, x: torch.Tensor) -> float:
        scale = self.scales[layer][which]
        if scale == 0.0:
            amax = float(x.detach().abs().max()) if x.numel() else 0.0
            scale = amax * HEADROOM / torch.finfo(self.fp8).max if amax > 0 else 1.0
            self.scales[layer][which] = scale
        return scale

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K and V as fp8 bytes, fixing the layer's scales on its first write."""
        return (encode(k, self.fp8, self._scale(layer, 0, k)), encode(v, self.fp8, self._scale(layer, 1, v)))

    def stamp(self, meta, layer: int) -> None:
        """Tell the kernels how to read this layer (the metadata is the step's; every layer restamps it)."""
        meta.kv_fp8 = self.fp8
        meta.k_scale, meta.v_scale = self.scales[layer]


def make_quant(shape, given: float = 0.0) -> KVQuant | None:
    """The cache's quantiser, or None when K/V are stored in the compute dtype."""
    return None if shape.fp8_dtype is None else KVQuant(shape.fp8_dtype, shape.num_layers, given)


def read_kv(k: torch.Tensor, v: torch.Tensor, meta, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the kernel computes with them: dequantised when the cache holds fp8 bytes, else as they are."""
    if getattr(meta, "kv_fp8", None) is None:
        return k, v
    return decode(k, meta.kv_fp8, meta.k_scale, dtype), decode(v, meta.kv_fp8, meta.v_scale, dtype)
