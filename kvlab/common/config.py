"""Engine configuration: dataclasses, TOML loading, keyword/CLI overrides, validation.

Generic settings live in EngineConfig; each backend's own settings live in its options dataclass (declared by
its spec, found through the registry) under `EngineConfig.options[backend]`. TOML gives them as tables
(`[paged]`, `[vmm]`, `[reserve]`); flat keys (`block_size = 32`, `--block-size 32`, `LLM(block_size=32)`)
still work and go to the backend that declares them.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import ConfigError
from kvlab.common.kv.dtype_names import KV_CACHE_DTYPES
from kvlab.common.kv.options import check_choice, check_positive, check_types
from kvlab.common.kv.registry import REGISTRY
from kvlab.common.limits import MAX_MODEL_LEN, MAX_SEED
from kvlab.common.linear_names import LINEAR_CHOICES
from kvlab.common.machine import check_fits_in_ram, max_threads
from kvlab.common.validate import check_int, check_number, shown

if TYPE_CHECKING:
    from kvlab.common.kv.registry import BackendSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PREEMPTION_MODES = ("recompute", "swap")
KV_ROLES = ("colocated", "prefill", "decode")
DTYPES = ("float32", "float16", "bfloat16")
DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
POOL_KEYS = ("kv_pool", "kv_pool_bytes")   # engine-level, also accepted in a pool backend's table
KV_SCALE_RANGE = (1e-6, 1e6)       # fp8 KV scales of real models are ~1e-3..10; beyond this K/V underflow or saturate


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny"                  # preset name, HF directory, or .gguf file
    backend: str = "paged"               # a registered backend: paged | vmm | reserve
    kv_cache_bytes: int | None = None    # the KV budget, all layers, K and V; None: sized from the model
                                         # (common/loader.py default_kv_cache_bytes)
    watermark: float = 0.01              # fraction of capacity kept free at admission
    preemption_mode: str = "recompute"   # recompute | swap
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None     # None: the model's max_position_embeddings, capped by the KV budget
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"         # auto (= dtype) | fp8_e4m3 | fp8_e5m2 (vLLM's names): 1-byte K/V
    kv_cache_scale: float = 0.0          # fp8 scale for every layer's K and V; 0 = per layer from the first prefill
    device: str = "cpu"
    kernel: str = "auto"                 # auto or a registry name
    linear: str = "auto"                 # the Linear layers' GEMM: auto | onednn | torch (common/linear.py)
    seed: int = 0
    threads: int = 1                     # torch threads; 0 = torch's own default. 1 measured fastest on the
                                         # 2-vCPU box (docs/experiments.md "Threads"): more threads spin and thrash
    enable_prefix_caching: bool = False
    check_invariants: bool = False       # debug: verify mapped coverage before every kernel call
    tensor_parallel_size: int = 1        # ranks sharding the model and KV heads (common/dist/)
    kv_role: str = "colocated"           # colocated | prefill | decode: P/D disaggregation (common/handoff/)
    handoff_timeout_s: float = 30.0      # prefill role: kept KV nobody pulls within this is freed (expired)
    handoff_name: str | None = None      # prefill role: serve pulls at this fixed name (None: a random one)
    handoff_peers: tuple[str, ...] = ()  # decode role: pull only from prefill engines of these names (): any of
                                         # this user's)
    kv_pool: str | None = None           # draw KV pages from this machine-wide pool (docs/pool.md); backends
                                         # whose spec says `pool` (pages mapped on demand) accept it
    kv_pool_bytes: int | None = None     # create kv_pool with this budget if no engine serves it yet
    options: dict[str, Any] = field(default_factory=dict)   # backend name -> its options dataclass

    def __post_init__(self) -> None:
        for spec in REGISTRY.specs():
            self.options.setdefault(spec.name, spec.default_options())
        validate(self)
        if self.kv_cache_bytes is None:
            from kvlab.common.loader import default_kv_cache_bytes
            self.kv_cache_bytes = default_kv_cache_bytes(self)
        if self.max_model_len is None:
            from kvlab.common.loader import default_max_model_len
            self.max_model_len = default_max_model_len(self)

    @property
    def spec(self) -> BackendSpec:
        """The registered spec of `backend`: how to build its cache, its unit, its options."""
        return REGISTRY.get(self.backend)

    def options_of(self, backend: str) -> Any:
        """The options dataclass of `backend` (its defaults if it registered after this config was made)."""
        if backend not in self.options:
            self.options[backend] = REGISTRY.get(backend).default_options()
        return self.options[backend]

    def __getattr__(self, name: str) -> Any:
        """Flat reads of backend options (`config.block_size`) keep working: the owning backend's value."""
        owner = REGISTRY.option_owner().get(name)
        if owner is None or name.startswith("_"):
            raise AttributeError(f"'EngineConfig' object has no attribute {name!r}")
        return getattr(self.options_of(owner), name)

    @property
    def backend_options(self) -> Any:
        return self.options_of(self.backend)

    def replace(self, **overrides: Any) -> EngineConfig:
        """A copy with generic and flat backend keys changed (the options of other backends are copied)."""
        generic, per_backend = split_overrides(overrides)
        options = {name: dataclasses.replace(opts, **per_backend.pop(name, {}))
                   for name, opts in self.options.items()}
        for name, values in per_backend.items():
            options[name] = REGISTRY.get(name).options(**values)
        return dataclasses.replace(self, **generic, options=options)

    def to_dict(self) -> dict[str, Any]:
        """Generic keys at top level, each backend's options as a nested table."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        out.update({name: dataclasses.asdict(opts) for name, opts in self.options.items()})
        return out


def validate(cfg: EngineConfig) -> None:
    check_positive(cfg, "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
    if cfg.kv_cache_bytes is not None:               # None: sized from the model once the rest is valid
        check_positive(cfg, "kv_cache_bytes")
    check_types(cfg)
    if cfg.backend not in REGISTRY.names():
        raise ConfigError(f"unknown backend {cfg.backend!r}; choose one of: {', '.join(REGISTRY.names())}")
    check_choice("preemption_mode", cfg.preemption_mode, PREEMPTION_MODES)
    check_choice("dtype", cfg.dtype, DTYPES)
    check_choice("kv_cache_dtype", cfg.kv_cache_dtype, KV_CACHE_DTYPES)
    check_choice("linear", cfg.linear, LINEAR_CHOICES)
    check_kv_cache_scale(cfg.kv_cache_scale, cfg.kv_cache_dtype)
    if not 0.0 <= cfg.watermark < 1.0:
        raise ConfigError(f"watermark must be a fraction in [0, 1), got {cfg.watermark!r}")
    if not DEVICE.fullmatch(cfg.device):
        raise ConfigError(f"unknown device {cfg.device!r}; use cpu or cuda[:N]")
    if cfg.threads < 0:
        raise ConfigError(f"threads must be >= 0 (0 keeps torch's default), got {cfg.threads!r}")
    check_int("threads", cfg.threads, 0, max_threads(), " (at most 4 per CPU)")
    check_int("seed", cfg.seed, 0, MAX_SEED)
    if cfg.max_model_len is not None:                 # None: set from the model once the rest is valid
        check_positive(cfg, "max_model_len")
        check_int("max_model_len", cfg.max_model_len, 1, MAX_MODEL_LEN, " (tokens per sequence)")
    if cfg.max_num_batched_tokens < cfg.max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
                          f"({cfg.max_num_seqs}) so every running sequence can decode in one step")
    check_choice("kv_role", cfg.kv_role, KV_ROLES)
    check_number("handoff_timeout_s", cfg.handoff_timeout_s, 0.01, 86400.0, unit=" seconds")
    check_handoff_names(cfg)
    check_pool(cfg)
    for name, opts in cfg.options.items():
        opts.validate()
        check_types(opts, where=f"{name}.")    # also for a backend whose validate() forgets it
        check_selected_only(name, opts, cfg.backend)


HANDOFF_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_handoff_names(cfg: EngineConfig) -> None:
    """handoff_name is a prefill engine's, handoff_peers a decode engine's; each name a short plain word."""
    if cfg.handoff_name is not None and cfg.kv_role != "prefill":
        raise ConfigError(f"handoff_name names a prefill engine's handoff address; this engine's kv_role is "
                          f"{cfg.kv_role}")
    if cfg.handoff_peers and cfg.kv_role != "decode":
        raise ConfigError(f"handoff_peers lists the prefill engines a decode engine pulls from; this engine's "
                          f"kv_role is {cfg.kv_role}")
    if not isinstance(cfg.handoff_peers, (list, tuple)):
        raise ConfigError(f"handoff_peers is a list of prefill engines' handoff names, got {shown(cfg.handoff_peers)}")
    for name in ([cfg.handoff_name] if cfg.handoff_name is not None else []) + list(cfg.handoff_peers):
        if not isinstance(name, str) or not HANDOFF_NAME.fullmatch(name):
            raise ConfigError(f"a handoff name is 1-64 letters, digits, '_', '.' or '-', got {shown(name)}")


def check_pool(cfg: EngineConfig) -> None:
    """kv_pool needs a backend whose spec takes pages from a pool; kv_pool_bytes needs kv_pool, and on the CPU a
    size this machine's RAM can hold (as `kvlab pool create` refuses it)."""
    size = cfg.kv_pool_bytes
    if size is not None and (cfg.kv_pool is None or size <= 0):
        raise ConfigError(f"kv_pool_bytes needs kv_pool and a positive size, got {size!r}")
    if cfg.kv_pool is not None and not cfg.spec.pool:
        able = " or ".join(s.name for s in REGISTRY.specs() if s.pool)
        raise ConfigError(f"kv_pool needs a backend whose pages are mapped on demand ({able}), not {cfg.backend!r}")
    if size is not None and cfg.device == "cpu":
        check_fits_in_ram(f"kv_pool_bytes {size:,}", size, "lower kv_pool_bytes")


def check_kv_cache_scale(scale: float, kv_cache_dtype: str) -> None:
    """0 (from the first prefill), or a scale an fp8 cache can use: x / scale neither underflows nor saturates
    for K/V of any real model, and fp8_max * scale stays finite in fp32."""
    if scale == 0:
        return
    check_number("kv_cache_scale", scale, KV_SCALE_RANGE[0], KV_SCALE_RANGE[1], unit=" (or 0: from the first prefill)")
    if kv_cache_dtype == "auto":
        raise ConfigError(f"kv_cache_scale {scale:g} applies only to an fp8 kv_cache_dtype (fp8_e4m3, fp8_e5m2); "
                          "kv_cache_dtype is auto")


def check_selected_only(name: str, opts: Any, backend: str) -> None:
    """A backend option whose field metadata says `selected_only` (why it needs that backend) is an error when
    set away from its default while another backend is chosen."""
    if name == backend:
        return
    for f in fields(opts):
        why = f.metadata.get("selected_only")
        if why and getattr(opts, f.name) != f.default:
            raise ConfigError(f"{f.name} needs the {name} backend ({why}), not {backend!r}")


def split_overrides(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Generic keys, and flat or tabled backend keys grouped by backend. Unknown keys are one error."""
    generic_names = {f.name for f in fields(EngineConfig)} - {"options"}
    owner = REGISTRY.option_owner()
    generic: dict[str, Any] = {}
    per_backend: dict[str, dict[str, Any]] = {}
    unknown = []
    for key, value in values.items():
        if key in generic_names:
            generic[key] = value
        elif key in owner:
            per_backend.setdefault(owner[key], {})[key] = value
        elif key in REGISTRY.names():
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a table of {key} options ([{key}] in TOML), got {value!r}")
            per_backend.setdefault(key, {}).update(value)
            hoist_pool_keys(key, per_backend[key], generic)
        else:
            unknown.append(key)
    for name, table in per_backend.items():
        known = {f.name for f in fields(REGISTRY.get(name).options)}
        unknown += [f"{name}.{k}" for k in table if k not in known]
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(sorted(unknown))}")
    return generic, per_backend


def hoist_pool_keys(backend: str, table: dict[str, Any], generic: dict[str, Any]) -> None:
    """The pool keys are engine-level, and also spelled in a pool backend's table (`[vmm] kv_pool = "gpu0"`, as
    before they were); a flat key given too wins."""
    if REGISTRY.get(backend).pool:
        for key in POOL_KEYS:
            if key in table:
                generic.setdefault(key, table.pop(key))


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; generic keys may sit at top level or under an [engine] table, backend options under
    their backend's table ([paged], [vmm], [reserve]) or flat."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    engine = data.pop("engine", {})
    if not isinstance(engine, dict):
        raise ConfigError(f"config file {path}: engine must be a table ([engine]), got {engine!r}")
    values = dict(engine)
    values.update(data)
    return values


def make_config(config_file: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Defaults < TOML file < keyword overrides (None values are ignored, as from unset CLI flags)."""
    values: dict[str, Any] = load_toml(config_file) if config_file else {}
    for key, value in overrides.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    generic, per_backend = split_overrides(values)
    options = {name: REGISTRY.get(name).options(**table) for name, table in per_backend.items()}
    return EngineConfig(**generic, options=options)


def config_fields() -> list[dataclasses.Field]:
    """The generic fields (backend options are in each spec's options dataclass)."""
    return [f for f in fields(EngineConfig) if f.name != "options"]


__all__ = ["EngineConfig", "config_fields", "load_toml", "make_config", "split_overrides", "validate"]
