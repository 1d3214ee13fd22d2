"""A Llama-family model's shape and options, checked on construction (torch-free: the simulator and the roofline
read it without loading a model; common/model.py builds the model from it)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.common.errors import ModelLoadError

# Far beyond any released Llama (405B: 126 layers, 128 heads, vocab 128k); a corrupt header past these would
# build millions of modules before memory runs out.
SANE_MAXIMA = {"num_layers": 1024, "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 4096,
               "vocab_size": 2**24, "hidden_size": 2**17, "intermediate_size": 2**20,
               "max_position_embeddings": 2**24}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None          # None, or llama3-style: the LLAMA3_ROPE_KEYS
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    sliding_window: int | None = None         # Mistral: every layer sees the last W positions only

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"model config: {name} must be a positive integer, got {value!r}")
        for name, limit in SANE_MAXIMA.items():
            if getattr(self, name) > limit:
                raise ModelLoadError(f"model config: {name} {getattr(self, name):,} exceeds the sane maximum "
                                     f"{limit:,}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"model config: num_heads {self.num_heads} is not a multiple of "
                                 f"num_kv_heads {self.num_kv_heads}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ModelLoadError(f"model config: sliding_window must be a positive integer or None, "
                                 f"got {self.sliding_window!r}")
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim {self.head_dim} must be even for RoPE")
        for name in ("rope_theta", "rms_norm_eps"):
            if not is_positive_number(getattr(self, name)):
                raise ModelLoadError(f"model config: {name} must be a positive finite number, "
                                     f"got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ModelLoadError(f"model config: rope_scaling must be a table of numbers, "
                                     f"got {self.rope_scaling!r}")
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if missing:
                raise ModelLoadError(f"model config: llama3 rope_scaling lacks {', '.join(missing)}")
            bad = [k for k in LLAMA3_ROPE_KEYS if not is_positive_number(self.rope_scaling[k])]
            if bad:
                raise ModelLoadError(f"model config: rope_scaling {bad[0]} must be a positive finite number, "
                                     f"got {self.rope_scaling[bad[0]]!r}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (HF configs may list several)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def num_params(self) -> int:
        d, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads
        attn = d * (q + 2 * kv) * self.head_dim + q * self.head_dim * d
        per_layer = attn + 3 * d * i + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head


def is_positive_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)
