"""What every checkpoint format shares: building a ModelConfig with one-line errors, and assigning named
tensors to a model's parameters."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvlab.common.errors import ConfigError, ModelLoadError
from kvlab.common.machine import fmt_bytes, ram_bytes
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import ModelConfig

log = logging.getLogger("kvlab.common.loader")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)     # buffers some old checkpoints saved


def assign_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor, Path]],
                   source: Path) -> None:
    """Copy HF-named tensors into the model's (possibly fused) parameters; every weight must be filled once."""
    targets = model.hf_weight_targets()
    seen: set[str] = set()
    for name, tensor, file in tensors:
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            log.info("%s: ignoring %s (not a parameter of this model)", file, name)
            continue
        if name not in targets:
            raise ModelLoadError(f"{file}: unexpected tensor {name!r} (not a Llama weight of this config)")
        if name in seen:
            raise ModelLoadError(f"{file}: tensor {name!r} appears more than once")
        param, first, rows = targets[name]
        expected = (rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, the config "
                                 f"implies {expected}")
        with torch.no_grad():
            param[first:first + rows].copy_(tensor)
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{source}: missing tensor {missing[0]!r}{more}")


# -- HF directories -------------------------------------------------------------------------------------------


def make_config(source: Path, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None


def model_bytes(config: ModelConfig, dtype: str) -> int:
    """Host/device memory a model of `config` takes: its parameters plus the RoPE cos/sin tables."""
    size = 4 if dtype == "float32" else 2
    rope = 2 * config.max_position_embeddings * config.head_dim * size
    return config.num_params * size + rope


def check_fits(config: ModelConfig, dtype: str, device: str, source: Path | str) -> None:
    """Refuse a model that cannot fit in memory before a single parameter is allocated (a 100 KB file can
    declare 10**6 layers or a 3e8-token context)."""
    need = model_bytes(config, dtype)
    if device.startswith("cuda"):
        import torch
        index = torch.device(device).index or 0
        limit, where = torch.cuda.get_device_properties(index).total_memory, f"{device}'s memory"
    else:
        limit, where = ram_bytes(), "this machine's RAM"
    if need > limit:
        raise ModelLoadError(f"{source}: the model needs {fmt_bytes(need)} ({config.num_params:,} parameters, "
                             f"{config.max_position_embeddings:,} positions in {dtype}), more than {where} "
                             f"({fmt_bytes(limit)})")


def check_device(device: str) -> None:
    """A CUDA device that exists (config validation checks only the spelling)."""
    if not device.startswith("cuda"):
        return
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if count == 0:
        raise ConfigError(f"device {device!r}: no CUDA GPU is available here (torch sees none); use --device cpu")
    if index >= count:
        raise ConfigError(f"device {device!r}: only {count} CUDA device(s) here (cuda:0..cuda:{count - 1})")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- GGUF -------------------------------------------------------------------------------------------------
