"""Random tiny HF checkpoints for parity tests: non-trivial weights (std 0.05, norms around 1), saved to a folder.
The callers import transformers through pytest.importorskip first."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 320
SMALL = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "attn_implementation": "eager"}


def randomized_save(hf: Any, path: Path, seed: int) -> Any:
    """Fill `hf`'s weights from `seed` (norms 1 + 0.1 noise, the rest 0.05 noise), save it to `path`, return it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    hf.save_pretrained(path)
    return hf


def mistral_checkpoint(path: Path, window: int | None, seed: int) -> Any:
    """A 2-layer Mistral (4 query heads, 2 KV heads of 32) with sliding window `window` (None: full attention)."""
    import transformers
    config = transformers.MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        sliding_window=window)
    return randomized_save(transformers.MistralForCausalLM(config).eval(), path, seed)
