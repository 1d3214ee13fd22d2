"""A Llama-family decoder whose attention layers write K/V and attend through the KV-cache seam.

`forward` is the engine's hot path: all batch items are concatenated into one varlen [T] batch, each layer
computes fused q|k|v, applies RoPE at the given positions and calls `cache.attention`. `reference_forward` is
the cache-free causal version the tests use as ground truth. RoPE and RMSNorm follow HF transformers'
arithmetic operation for operation, so fp32 logits agree to rounding.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.common.interrupts import interrupts_held
from kvlab.common.kv.torch_dtypes import TORCH_DTYPES
from kvlab.common.kv.types import KVShape
from kvlab.common.linear import TORCH, LinearImpl, choose_linear
from kvlab.common.model_config import ModelConfig

if TYPE_CHECKING:
    from kvlab.common.attention.metadata import AttentionMetadata
    from kvlab.common.kv.seam import KVCache

# -- RoPE -----------------------------------------------------------------------------------------------

def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, computed exactly as HF transformers does."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is None:
        return inv_freq
    s = config.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelConfig, num_positions: int, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_positions, head_dim / 2] (the two halves HF concatenates are equal)."""
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * rope_inv_freq(config)[None, :]
    return freqs.cos().to(dtype=dtype, device=device), freqs.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dim; cos/sin broadcast against x[..., :D/2]. Returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# -- layers -----------------------------------------------------------------------------------------------

class Linear(nn.Linear):
    """A bias-free nn.Linear whose GEMM is the model's choice (`LlamaForCausalLM.use_linear`, common/linear.py)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.gemm = TORCH.fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # fused kernel; same arithmetic as the general path
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """GQA attention with fused q|k|v projection."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., H, D], k and v [..., H_kv, D], RoPE applied; all contiguous."""
        lead = x.shape[:-1]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(q.view(*lead, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(*lead, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.reshape(*lead, self.num_kv_heads, self.head_dim).contiguous()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        out = cache.attention(self.layer_idx, q, k, v, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))

    def reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden]: causal attention with no cache."""
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, cos, sin))
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = None
        if self.sliding_window is not None:   # causal, in the window: key j visible to query i iff i - W < j <= i
            pos = torch.arange(x.shape[1], device=x.device)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < self.sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], self.q_size))


class MLP(nn.Module):
    """SwiGLU with fused gate|up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                meta: AttentionMetadata | None) -> torch.Tensor:
        x = self.input_layernorm(h)
        if cache is None:
            h = h + self.self_attn.reference(x, cos, sin)
        else:
            h = h + self.self_attn(x, cos, sin, cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


# -- the model ----------------------------------------------------------------------------------------------

class LlamaForCausalLM(nn.Module):
    """Parameters are allocated uninitialised: call `init_random_weights` or load every weight."""

    # HF parameter -> (our fused parameter, index of its row block in that parameter)
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
        with interrupts_held(), torch.device("meta"):   # the device mode calls back into Python from C++
            # a weight given: no normal_ on a meta tensor, whose Python decomposition imports torch._dynamo (~2 s)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                             _weight=torch.empty(config.vocab_size, config.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.to_empty(device=device)
        self.to(dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_len = 0
        self.ensure_rope_len(config.max_position_embeddings)
        self.linear = TORCH

    def use_linear(self, requested: str) -> LinearImpl:
        """Run every Linear layer through the GEMM `requested` picks (common/linear.py); returns the choice."""
        self.linear = choose_linear(requested, self.dtype, self.device)
        for module in self.modules():
            if isinstance(module, Linear):
                module.gemm = self.linear.fn
        return self.linear

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def ensure_rope_len(self, num_positions: int) -> None:
        """Make the cached cos/sin tables cover positions [0, num_positions)."""
        if num_positions > self.rope_len:
            cos, sin = rope_tables(self.config, num_positions, self.dtype, self.device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            self.rope_len = num_positions

    def kv_shape(self, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None
                 ) -> KVShape:
        dtype = dtype if dtype is not None else self.dtype
        if isinstance(dtype, torch.dtype):
            dtype = {v: k for k, v in TORCH_DTYPES.items()}[dtype]
        c = self.config
        return KVShape(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       num_q_heads=c.num_heads, dtype=dtype, device=str(device or self.device),
                       sliding_window=c.sliding_window)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] (all items concatenated) -> fp32 logits [len(meta.logits_indices), V].
        Positions must be < the RoPE table length (max_position_embeddings; grow it with ensure_rope_len)."""
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        meta.sliding_window = self.config.sliding_window   # the kernels mask (and read) only the window
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, cache, meta)
        return self.lm_head(self.norm(h[meta.logits_indices])).float()

    @torch.inference_mode()
    def reference_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> fp32 logits [B, S, V]; causal attention, no cache, positions 0..S-1."""
        seq_len = input_ids.shape[1]
        self.ensure_rope_len(seq_len)
        cos, sin = self.rope_cos[:seq_len].unsqueeze(1), self.rope_sin[:seq_len].unsqueeze(1)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, None, None)
        return self.lm_head(self.norm(h)).float()

    # -- weights ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_random_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic random weights (HF's Llama init: normal(0, std), norms at one)."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)

    def hf_weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF checkpoint name -> (our parameter, first row, row count) that the tensor fills.
        The tied lm_head is absent: HF checkpoints of tied models do not store it."""
        targets: dict[str, tuple[torch.Tensor, int, int]] = {}
        for name, param in self.named_parameters(remove_duplicate=True):
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            hf_prefix = name if name.startswith("lm_head") else f"model.{name}"
            if module not in ("qkv_proj", "gate_up_proj"):
                targets[hf_prefix] = (param, 0, param.shape[0])
                continue
            for hf_module, (fused, index) in self.FUSED.items():
                if fused == module:
                    first, rows = self._fused_block(module, index)
                    targets[f"model.{parent}.{hf_module}.{leaf}"] = (param, first, rows)
        return targets

    def _fused_block(self, module: str, index: int) -> tuple[int, int]:
        c = self.config
        if module == "gate_up_proj":
            return index * c.intermediate_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return (0, q) if index == 0 else (q + (index - 1) * kv, kv)
