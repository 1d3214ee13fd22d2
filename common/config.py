"""Engine configuration: dataclasses, TOML loading, keyword/CLI overrides, validation."""
from __future__ import annotations

import dataclasses
import math
import mmap
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BACKENDS = ("paged", "vmm", "reserve")
PREEMPTION_MODES = ("recompute", "swap")
RESERVE_MODES = ("max", "oracle")
DTYPES = ("float32", "float16", "bfloat16")
HOST_PAGE = mmap.PAGESIZE


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny"                  # preset name, HF directory, or .gguf file
    backend: str = "paged"               # paged | vmm | reserve
    block_size: int = 16                 # tokens per block (paged)
    page_size: int = 64 * 1024           # bytes per physical page (vmm)
    kv_cache_bytes: int = 64 * 1024**2   # the KV budget, all layers, K and V
    watermark: float = 0.01              # fraction of capacity kept free at admission
    preemption_mode: str = "recompute"   # recompute | swap
    reserve_mode: str = "max"            # max | oracle (reserve backend)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024
    dtype: str = "float32"
    device: str = "cpu"
    kernel: str = "auto"                 # auto or a registry name
    seed: int = 0
    threads: int = 0                     # torch threads; 0 = leave torch's default
    enable_prefix_caching: bool = False
    background_mapping: bool = False     # vmm: map ahead of need on a worker thread
    vmm_single_range: bool = False       # vmm: one reserved range for all 2L tensors instead of one each
    check_invariants: bool = False       # debug: verify mapped coverage before every kernel call

    def __post_init__(self) -> None:
        validate(self)

    def replace(self, **overrides: Any) -> EngineConfig:
        unknown = set(overrides) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_positive(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")


def validate(cfg: EngineConfig) -> None:
    _check_positive(cfg, "block_size", "page_size", "kv_cache_bytes", "max_num_seqs",
                    "max_num_batched_tokens", "max_model_len")
    _check_choice("backend", cfg.backend, BACKENDS)
    _check_choice("preemption_mode", cfg.preemption_mode, PREEMPTION_MODES)
    _check_choice("reserve_mode", cfg.reserve_mode, RESERVE_MODES)
    _check_choice("dtype", cfg.dtype, DTYPES)
    if cfg.page_size % HOST_PAGE:
        raise ConfigError(f"page_size {cfg.page_size} is not a multiple of the host page size {HOST_PAGE}")
    if not (isinstance(cfg.watermark, (int, float)) and 0.0 <= cfg.watermark < 1.0) or math.isnan(cfg.watermark):
        raise ConfigError(f"watermark must be a fraction in [0, 1), got {cfg.watermark!r}")
    if not cfg.device.startswith(("cpu", "cuda")):
        raise ConfigError(f"unknown device {cfg.device!r}; use cpu or cuda[:N]")
    if not isinstance(cfg.vmm_single_range, bool):
        raise ConfigError(f"vmm_single_range must be true or false, got {cfg.vmm_single_range!r}")
    if not isinstance(cfg.threads, int) or cfg.threads < 0:
        raise ConfigError(f"threads must be >= 0 (0 keeps torch's default), got {cfg.threads!r}")
    if cfg.max_num_batched_tokens < cfg.max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
                          f"({cfg.max_num_seqs}) so every running sequence can decode in one step")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; keys may sit at top level or under an [engine] table."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    return dict(data.get("engine", data))


def make_config(config_file: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Defaults < TOML file < keyword overrides (None values are ignored, as from unset CLI flags)."""
    values: dict[str, Any] = load_toml(config_file) if config_file else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(EngineConfig)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(sorted(unknown))}")
    return EngineConfig(**values)


def config_fields() -> list[dataclasses.Field]:
    return list(fields(EngineConfig))


__all__ = ["BACKENDS", "HOST_PAGE", "EngineConfig", "config_fields", "load_toml", "make_config", "validate"]
