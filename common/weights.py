"""What every checkpoint format shares: building a ModelConfig with one-line errors, and assigning named
tensors to a model's parameters."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from kvlab.common.errors import ModelLoadError
from kvlab.common.model import LlamaForCausalLM, ModelConfig

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


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- GGUF -------------------------------------------------------------------------------------------------
