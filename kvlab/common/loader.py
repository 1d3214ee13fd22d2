"""Load a model: a preset name, an HF-format directory (config.json + safetensors, sharded or not) or a GGUF
file. Every problem with a file surfaces as one ModelLoadError line naming the file and what is wrong."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvlab.common.errors import ConfigError, KvlabError, ModelLoadError
from kvlab.common.gguf_file import load_gguf
from kvlab.common.kv.torch_dtypes import TORCH_DTYPES
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import LLAMA3_ROPE_KEYS, ModelConfig
from kvlab.common.presets import PRESETS, load_preset
from kvlab.common.tokenizer import BPETokenizer
from kvlab.common.validate import user_path
from kvlab.common.weights import assign_weights, check_device, check_fits, first_line, make_config

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_MODEL_TYPES = ("llama", "mistral")   # same weights and blocks; mistral may add a sliding window
MODEL_FILE_SUFFIXES = (".gguf", ".safetensors")  # a missing path with one of these was meant as a model file


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
               seed: int = 0):
    """-> (LlamaForCausalLM in eval mode, tokenizer or None). `seed` only matters for random presets."""
    if isinstance(dtype, torch.dtype):
        dtype = {v: k for k, v in TORCH_DTYPES.items()}[dtype]
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(TORCH_DTYPES)}")
    check_device(device)
    kind, path = locate(name_or_path)
    if kind == "preset":
        return load_preset(str(name_or_path), dtype, device, seed)
    if kind == "hf":
        return load_hf_dir(path, dtype, device)
    return load_gguf(path, dtype, device)


def locate(name_or_path: str | Path) -> tuple[str, Path]:
    """("preset" | "hf" | "gguf", path): what a model name names; anything else is one ModelLoadError line."""
    name = str(name_or_path)
    path = user_path(name)
    if name in PRESETS:
        return "preset", path
    if path.is_dir():
        return "hf", path
    if path.is_file():
        return "gguf", path
    kind = missing_path_kind(name)
    if kind is not None and not path.exists():
        raise ModelLoadError(f"model {kind} {name!r} does not exist; give an existing .gguf file, an HF "
                             f"directory or a preset ({', '.join(PRESETS)})")
    raise ModelLoadError(f"model {name!r} is neither a preset ({', '.join(PRESETS)}), an HF directory "
                         "nor a .gguf file")


def missing_path_kind(name: str) -> str | None:
    """What a name not found on disk was meant to be: a model "file" (by its suffix), a "directory" (it has a
    path separator or starts like a path), or None (a bare name: an unknown preset, answered with the list)."""
    if name.lower().endswith(MODEL_FILE_SUFFIXES):
        return "file"
    if "/" in name or "\\" in name or name.startswith(("~", ".")):
        return "directory"
    return None


# -- weights --------------------------------------------------------------------------------------------------

def load_hf_dir(path: Path, dtype: str, device: str):
    config = config_from_hf(read_json(path / "config.json"), path / "config.json")
    check_fits(config, dtype, device, path)
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    assign_weights(model, iter_safetensors(path), path)
    return model.eval(), hf_tokenizer(path, config)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: an HF model directory needs config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:                  # nested thousands of levels deep
        raise ModelLoadError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def config_from_hf(cfg: dict[str, Any], source: Path) -> ModelConfig:
    """A ModelConfig from a transformers LlamaConfig or MistralConfig dict (v4 `rope_scaling` or v5
    `rope_parameters`); Mistral adds `sliding_window` (None or absent: full attention)."""
    kind = cfg.get("model_type", "llama")
    if kind not in HF_MODEL_TYPES:
        raise ModelLoadError(f"{source}: model_type {kind!r} is not supported ({' or '.join(HF_MODEL_TYPES)})")
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if cfg.get(key, ok) != ok:
            raise ModelLoadError(f"{source}: {key}={cfg[key]!r} is not supported (need {ok!r})")

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelLoadError(f"{source}: missing {key!r}")
        return cfg[key]

    def size(key: str, value: Any = None) -> int:
        value = need(key) if value is None else value
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
        return value

    heads, hidden = size("num_attention_heads"), size("hidden_size")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object (or null), got {rope!r}")
    eos = cfg.get("eos_token_id")
    return make_config(
        source,
        vocab_size=size("vocab_size"), hidden_size=hidden,
        intermediate_size=size("intermediate_size"), num_layers=size("num_hidden_layers"),
        num_heads=heads, num_kv_heads=size("num_key_value_heads", cfg.get("num_key_value_heads") or heads),
        head_dim=size("head_dim", cfg.get("head_dim") or hidden // heads),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=hf_rope_scaling(rope, source),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=size("max_position_embeddings", cfg.get("max_position_embeddings", 2048)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        sliding_window=cfg.get("sliding_window") if kind == "mistral" else None,
    )


def hf_rope_scaling(rope: dict[str, Any], source: Path) -> dict[str, float] | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor is not supported")
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{source}: rope type {kind!r} is not supported (default or llama3)")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
    if missing:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    return {k: rope[k] for k in LLAMA3_ROPE_KEYS}


def safetensors_files(path: Path) -> list[Path]:
    index = path / SAFETENSORS_INDEX
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no 'weight_map'")
        files = [shard_path(path, name, index) for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f} not found (a shard listed in {index.name})")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (other checkpoint formats are not supported)")
    return files


def shard_path(path: Path, name: Any, index: Path) -> Path:
    """A shard named by the index: a plain file name inside the model directory, never `../` or absolute."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(f"{index}: weight_map values must be file names, got {name!r}")
    file = (path / name).resolve()
    if not file.is_relative_to(path.resolve()):
        raise ModelLoadError(f"{index}: shard {name!r} lies outside the model directory {path}")
    return path / name


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    from safetensors import SafetensorError, safe_open
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    yield name, f.get_tensor(name), file
        except (SafetensorError, OSError) as e:  # truncated, or not safetensors at all
            raise ModelLoadError(f"{file}: unreadable safetensors file ({first_line(e)})") from None


def hf_tokenizer(path: Path, config: ModelConfig):
    file = path / "tokenizer.json"
    if not file.is_file():
        log.warning("%s: no tokenizer.json; the model is loaded without a tokenizer (token ids only)", path)
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        log.warning("%s: the 'tokenizers' package is not installed; loading without a tokenizer "
                    "(pip install tokenizers)", file)
        return None
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    return BPETokenizer.from_file(file, config.bos_token_id, eos)



# -- max_model_len's default ----------------------------------------------------------------------------------

def read_model_config(name_or_path: str | Path) -> ModelConfig:
    """A model's ModelConfig without its weights: a preset's, an HF directory's config.json, a GGUF file's
    metadata (same checks, same errors as load_model)."""
    kind, path = locate(name_or_path)
    if kind == "hf":
        return config_from_hf(read_json(path / "config.json"), path / "config.json")
    if kind == "gguf":
        return gguf_config(path)
    header = PRESET_HEADERS.get(str(name_or_path))
    return header() if header else load_preset(str(name_or_path))[0].config


def default_max_model_len(config: Any) -> int:
    """What `max_model_len` is when the user sets none (EngineConfig, LLM, the CLI, TOML), as in vLLM: the
    model's max_position_embeddings, capped by the tokens the KV budget holds; the cap is one warning line."""
    from kvlab.common.limits import MAX_MODEL_LEN
    model = read_model_config(config.model)
    positions = min(model.max_position_embeddings, MAX_MODEL_LEN)
    held = budget_tokens(config.replace(max_model_len=positions), model)
    if held is None or held >= positions:
        return positions
    need = -(-positions * config.kv_cache_bytes // held)
    logging.getLogger("kvlab.capacity").warning(
        "%s: the KV budget holds %s tokens, less than the model's %s positions: max_model_len is %s; raise "
        "--kv-cache-bytes to at least %s for the full length, or set --max-model-len", config.backend,
        f"{held:,}", f"{positions:,}", f"{held:,}", f"{need:,}")
    return held


# The KV budget when none is set: room for this many sequences of the model's full length (as vLLM sizes its cache
# for the model rather than for a constant), within a floor that keeps small models as they were and a ceiling
# that keeps a CPU run from taking a large share of the machine's RAM.
DEFAULT_KV_SEQUENCES = 4
DEFAULT_KV_FLOOR = 64 * 2**20
DEFAULT_KV_CEILING = 2**30
DEFAULT_KV_RAM_SHARE = 1 / 8


def default_kv_cache_bytes(config: Any) -> int:
    """`kv_cache_bytes` when the user sets none: DEFAULT_KV_SEQUENCES sequences of the model's full length
    (max_position_embeddings), at least 64 MiB, at most 1 GiB and 1/8 of physical RAM. The tiny preset keeps 64 MiB;
    SmolLM2-135M in fp32 gets 1 GiB (about 23,000 tokens) instead of 64 MiB's 1,456."""
    from kvlab.common.limits import MAX_MODEL_LEN
    from kvlab.common.machine import ram_bytes
    model = read_model_config(config.model)
    if not config.device.startswith("cuda"):      # a model beyond RAM is refused before any budget is reported
        check_fits(model, config.dtype, config.device, config.model)
    length = min(model.max_position_embeddings, MAX_MODEL_LEN)
    want = DEFAULT_KV_SEQUENCES * length * kv_shape_of(config, model, 1).bytes_per_token
    return int(max(DEFAULT_KV_FLOOR, min(want, DEFAULT_KV_CEILING, ram_bytes() * DEFAULT_KV_RAM_SHARE)))


def kv_shape_of(config: Any, model: ModelConfig, tp: int) -> Any:
    """The KV shape of one of `tp` ranks for `model` under `config`'s dtypes."""
    from kvlab.common.kv.types import KVShape
    return KVShape(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads // tp, head_dim=model.head_dim,
                   num_q_heads=model.num_heads // tp, dtype=config.dtype, device=config.device,
                   kv_cache_dtype=config.kv_cache_dtype, sliding_window=model.sliding_window)


def budget_tokens(config: Any, model: ModelConfig) -> int | None:
    """Tokens the KV cache of `config.backend` holds for `model`: the budget's tokens when that is twice
    max_model_len or more (nothing is built: a budget far above RAM must not cost an accounting build's
    tables), else an accounting-only build's capacity (no KV memory taken); None when no cache can be built
    (the engine's own build says why, in its turn). Under tensor parallelism that is one rank's cache: every
    rank holds the same tokens."""
    from kvlab.common.kv.seam import create_cache
    tp = config.tensor_parallel_size if model.num_kv_heads % config.tensor_parallel_size == 0 else 1
    shape = kv_shape_of(config, model, tp)
    tokens = config.kv_cache_bytes // tp // shape.bytes_per_token
    if tokens >= 2 * config.max_model_len:
        return tokens
    try:
        cache = create_cache(config.replace(kv_cache_bytes=config.kv_cache_bytes // tp,
                                            max_model_len=max(1, min(config.max_model_len, tokens))),
                             shape, accounting_only=True)          # reserve sizes its regions by max_model_len
    except KvlabError:
        return None
    try:
        stats = cache.stats()
        return min(tokens, stats.total_units * max(1, stats.tokens_per_unit)) or None
    finally:
        cache.close()


def gguf_config(path: Path) -> ModelConfig:
    from kvlab.common.gguf_file import GGUFMeta, config_from_gguf, open_gguf
    reader = open_gguf(path)
    return config_from_gguf(GGUFMeta(reader, path), {t.name for t in reader.tensors})


def _smollm2_config() -> ModelConfig:
    from kvlab.common.presets import smollm2_gguf_path
    return gguf_config(smollm2_gguf_path())


def _tiny_config() -> ModelConfig:
    from kvlab.common.presets import TINY_CONFIG
    return TINY_CONFIG


PRESET_HEADERS = {"tiny": _tiny_config, "smollm2-135m": _smollm2_config}
