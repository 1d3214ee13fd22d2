"""What a kernel's rules may look at: the attention shape, and the device it runs on."""
from __future__ import annotations

from dataclasses import dataclass

PHASES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Everything a kernel's support predicate may look at."""
    layout: str                      # "paged" | "contiguous"
    device: str                      # "cpu" | "cuda"
    dtype: str                       # "float32" | "float16" | "bfloat16"
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int | None = None    # tokens per block (paged layout)
    compute_capability: tuple[int, int] | None = None  # cuda only
    # bytes of shared memory one thread block may use (opt-in maximum); None: known from the compute capability
    shared_memory_per_block: int | None = None
    kv_cache_dtype: str = "auto"     # auto (= dtype) | fp8_e4m3 | fp8_e5m2
    sliding_window: int | None = None   # attend to the last W keys only (Mistral); None: full causal

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def base_device(device: str) -> str:
    return device.split(":")[0]
