"""Load a model: a preset name, an HF-format directory (config.json + safetensors, sharded or not) or a GGUF
file. Every problem with a file surfaces as one ModelLoadError line naming the file and what is wrong."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvlab.common.errors import ConfigError, ModelLoadError
from kvlab.common.kv.seam import TORCH_DTYPES
from kvlab.common.model import LLAMA3_ROPE_KEYS, LlamaForCausalLM, ModelConfig
from kvlab.common.presets import PRESETS, load_preset
from kvlab.common.tokenizer import BPETokenizer

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)     # buffers some old checkpoints saved
MODEL_FILE_SUFFIXES = (".gguf", ".safetensors")  # a missing path with one of these was meant as a model file


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
               seed: int = 0):
    """-> (LlamaForCausalLM in eval mode, tokenizer or None). `seed` only matters for random presets."""
    if isinstance(dtype, torch.dtype):
        dtype = {v: k for k, v in TORCH_DTYPES.items()}[dtype]
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(TORCH_DTYPES)}")
    name = str(name_or_path)
    if name in PRESETS:
        return load_preset(name, dtype, device, seed)
    path = Path(name).expanduser()
    if path.is_dir():
        return load_hf_dir(path, dtype, device)
    if path.is_file():
        return load_gguf(path, dtype, device)
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

def load_hf_dir(path: Path, dtype: str, device: str):
    config = config_from_hf(read_json(path / "config.json"), path / "config.json")
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
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def config_from_hf(cfg: dict[str, Any], source: Path) -> ModelConfig:
    """A ModelConfig from a transformers LlamaConfig dict (v4 `rope_scaling` or v5 `rope_parameters`)."""
    if cfg.get("model_type", "llama") != "llama":
        raise ModelLoadError(f"{source}: model_type {cfg.get('model_type')!r} is not supported (only llama)")
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if cfg.get(key, ok) != ok:
            raise ModelLoadError(f"{source}: {key}={cfg[key]!r} is not supported (need {ok!r})")

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelLoadError(f"{source}: missing {key!r}")
        return cfg[key]

    heads = need("num_attention_heads")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return make_config(
        source,
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or need("hidden_size") // heads,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_scaling=hf_rope_scaling(rope, source),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(e) if isinstance(e := cfg.get("eos_token_id"), list) else e,
    )


def make_config(source: Path, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None


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
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f} not found (a shard listed in {index.name})")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (other checkpoint formats are not supported)")
    return files


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


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- GGUF -------------------------------------------------------------------------------------------------

GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
GGUF_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def load_gguf(path: Path, dtype: str = "float32", device: str = "cpu"):
    reader = open_gguf(path)
    meta = GGUFMeta(reader, path)
    tensor_names = {t.name for t in reader.tensors}
    config = config_from_gguf(meta, tensor_names)
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    assign_weights(model, iter_gguf_tensors(reader, config, path), path)
    return model.eval(), gguf_tokenizer(meta)


def open_gguf(path: Path):
    import gguf
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, LookupError, OSError, EOFError) as e:  # bad magic, truncation
        raise ModelLoadError(f"{path}: not a readable GGUF file ({first_line(e)})") from None


class GGUFMeta:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        if key not in self.fields:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.get(key)


def config_from_gguf(meta: GGUFMeta, tensor_names: set[str]) -> ModelConfig:
    arch = meta.need("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{meta.path}: GGUF architecture {arch!r} is not supported (only llama)")
    if "rope_freqs.weight" in tensor_names or meta.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise ModelLoadError(f"{meta.path}: GGUF rope scaling is not supported; use the HF checkpoint")
    hidden, heads = meta.need(f"{arch}.embedding_length"), meta.need(f"{arch}.attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{meta.path}: partial RoPE (rope.dimension_count != head_dim) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    return make_config(
        meta.path,
        vocab_size=meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None),
        hidden_size=hidden, intermediate_size=meta.need(f"{arch}.feed_forward_length"),
        num_layers=meta.need(f"{arch}.block_count"), num_heads=heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads), head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=meta.need(f"{arch}.context_length"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def gguf_to_hf_name(name: str) -> str | None:
    if name in GGUF_GLOBAL:
        return GGUF_GLOBAL[name]
    parts = name.split(".")   # blk.<i>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LAYER:
        return f"model.layers.{parts[1]}.{GGUF_LAYER[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion, which reorders each head's Q/K rows from HF's rotate-half layout to
    interleaved pairs; HF transformers applies the same inverse when it reads a GGUF."""
    if w.shape[0] % (2 * num_heads):
        return w   # wrong row count: assign_weights reports the shape mismatch
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader: Any, config: ModelConfig, path: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    from gguf.quants import dequantize
    for t in reader.tensors:
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {t.name!r} (not a llama weight)")
        try:
            array = dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise ModelLoadError(f"{path}: cannot dequantise {t.name!r} ({first_line(e)})") from None
        w = torch.from_numpy(np.array(array, dtype=np.float32))
        if ".q_proj." in hf_name:
            w = unpermute_rope_rows(w, config.num_heads)
        elif ".k_proj." in hf_name:
            w = unpermute_rope_rows(w, config.num_kv_heads)
        yield hf_name, w, path


def gguf_tokenizer(meta: GGUFMeta):
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        why = "no tokenizer metadata" if kind is None else f"tokenizer.ggml.model {kind!r} is not supported (gpt2 only)"
        log.warning("%s: %s; loading without a tokenizer", meta.path, why)
        return None
    return BPETokenizer.from_gguf_vocab(
        tokens=meta.need("tokenizer.ggml.tokens"), merges=meta.need("tokenizer.ggml.merges"),
        token_types=meta.get("tokenizer.ggml.token_type"), bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
