"""Sharding a Llama model over tp ranks: qkv and gate|up column-parallel, o and down row-parallel followed by
one all-reduce each; the embedding, norms and LM head are replicated (see docs/tensor-parallel.md).

A shard is an ordinary LlamaForCausalLM built from a ModelConfig with heads, KV heads and the MLP width
divided by tp, whose o_proj and down_proj are wrapped in `RowParallel`. Weights come from a `Reader`: a
callable (hf_name, dim, start, stop) -> tensor holding just that slice (dim None: the whole tensor)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from kvlab.common.errors import ConfigError, ModelLoadError
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import ModelConfig
from kvlab.common.weights import IGNORED_SUFFIXES
from torch import nn

Reader = Callable[[str, "int | None", int, int], torch.Tensor]
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def valid_sizes(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes this model shards evenly over (KV heads and MLP width both divide)."""
    return [t for t in range(1, config.num_kv_heads + 1)
            if config.num_kv_heads % t == 0 and config.intermediate_size % t == 0]


def check_tp_size(config: ModelConfig, tp: int) -> None:
    """Refuse (one line, naming the valid sizes) rather than replicate KV heads: see the docs for why."""
    if tp not in valid_sizes(config):
        raise ConfigError(f"tensor_parallel_size {tp} does not divide this model's {config.num_kv_heads} KV "
                          f"heads and {config.intermediate_size} MLP columns; valid sizes: "
                          f"{', '.join(map(str, valid_sizes(config)))}")


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    check_tp_size(config, tp)
    return dataclasses.replace(config, num_heads=config.num_heads // tp, num_kv_heads=config.num_kv_heads // tp,
                               intermediate_size=config.intermediate_size // tp)


class CommTimer:
    """Wall time this process spends in collectives (rank 0 reports it per step)."""

    def __init__(self) -> None:
        self.allreduce_s = 0.0
        self.allreduces = 0


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over ranks by one all-reduce."""

    def __init__(self, linear: nn.Linear, group: Any, timer: CommTimer) -> None:
        super().__init__()
        self.linear, self.group, self.timer = linear, group, timer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        start = time.perf_counter()
        dist.all_reduce(out, group=self.group)
        self.timer.allreduce_s += time.perf_counter() - start
        self.timer.allreduces += 1
        return out


def slice_of(name: str, param: torch.Tensor, rows: int, rank: int) -> tuple[int | None, int, int]:
    """(dim, start, stop) of the HF tensor `name` that this rank's shard holds."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if module in COLUMN_PARALLEL:
        return 0, rank * rows, (rank + 1) * rows
    if module in ROW_PARALLEL:
        cols = param.shape[1]
        return 1, rank * cols, (rank + 1) * cols
    return None, 0, 0


@torch.no_grad()
def build_shard(config: ModelConfig, rank: int, tp: int, read: Reader, dtype: Any, device: str,
                group: Any, timer: CommTimer) -> LlamaForCausalLM:
    """This rank's shard, every parameter filled from `read`, row-parallel layers wrapped."""
    model = LlamaForCausalLM(shard_config(config, tp), dtype=dtype, device=device)
    for name, (param, first, rows) in model.hf_weight_targets().items():
        dim, start, stop = slice_of(name, param, rows, rank)
        tensor = read(name, dim, start, stop)
        expected = (rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"tensor {name!r} slice has shape {tuple(tensor.shape)}, the shard needs {expected}")
        param[first:first + rows].copy_(tensor)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group, timer)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group, timer)
    model.tp_rank, model.tp_size = rank, tp
    return model.eval()


def model_reader(full: LlamaForCausalLM) -> Reader:
    """Slices of an in-memory full model (presets, GGUF: every rank loads it, keeps its shard)."""
    targets = full.hf_weight_targets()

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        param, first, rows = targets[name]
        tensor = param[first:first + rows]
        return tensor if dim is None else tensor.narrow(dim, start, stop - start)
    return read


class SafetensorsReader:
    """Slices straight from an HF directory's safetensors files (`safe_open(...).get_slice`): a rank never
    reads the parts of a column- or row-parallel weight that belong to other ranks. `reads` logs
    (name, dim, start, stop, shape read) for tests."""

    def __init__(self, path: Path) -> None:
        from kvlab.common.loader import safetensors_files
        from safetensors import safe_open
        self.handles = [safe_open(str(f), framework="pt", device="cpu") for f in safetensors_files(path)]
        self.where = {name: h for h in self.handles for name in h.keys()  # noqa: SIM118
                      if not name.endswith(IGNORED_SUFFIXES)}
        self.path = path
        self.reads: list[tuple[str, int | None, int, int, tuple[int, ...]]] = []

    def __call__(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in self.where:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        piece = self.where[name].get_slice(name)
        tensor = piece[:] if dim is None else piece[start:stop] if dim == 0 else piece[:, start:stop]
        self.reads.append((name, dim, start, stop, tuple(tensor.shape)))
        return tensor
