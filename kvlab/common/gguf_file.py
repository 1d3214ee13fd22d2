"""GGUF files (llama.cpp): metadata to ModelConfig, dequantised tensors with the Q/K rope permutation undone,
and the embedded BPE tokenizer."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.common.errors import ModelLoadError
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import ModelConfig
from kvlab.common.tokenizer import BPETokenizer
from kvlab.common.weights import assign_weights, check_fits, first_line, make_config

log = logging.getLogger("kvlab.common.loader")

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
    check_fits(config, dtype, device, path)
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
    for key, value in (("embedding_length", hidden), ("attention.head_count", heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"{meta.path}: GGUF {arch}.{key} must be a positive integer, got {value!r}")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{meta.path}: partial RoPE (rope.dimension_count != head_dim) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    check_block_count(meta, meta.need(f"{arch}.block_count"), tensor_names)
    return make_config(
        meta.path,
        vocab_size=meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None),
        hidden_size=hidden, intermediate_size=meta.need(f"{arch}.feed_forward_length"),
        num_layers=meta.need(f"{arch}.block_count"), num_heads=heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads), head_dim=head_dim,
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        rms_norm_eps=meta.need(f"{arch}.attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=meta.need(f"{arch}.context_length"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def check_block_count(meta: GGUFMeta, declared: Any, tensor_names: set[str]) -> None:
    """The header's block_count must match the blocks whose tensors the file holds (a 100 KB file that
    declares 10**6 blocks would otherwise build 10**6 layers before any weight is read)."""
    present = {name.split(".")[1] for name in tensor_names if name.startswith("blk.")}
    if isinstance(declared, int) and not isinstance(declared, bool) and declared != len(present):
        raise ModelLoadError(f"{meta.path}: GGUF block_count is {declared:,} but the file holds tensors for "
                             f"{len(present):,} block(s)")


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
    try:
        return BPETokenizer.from_gguf_vocab(
            tokens=meta.need("tokenizer.ggml.tokens"), merges=meta.need("tokenizer.ggml.merges"),
            token_types=meta.get("tokenizer.ggml.token_type"), bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own types for bad vocab/merges
        raise ModelLoadError(f"{meta.path}: the embedded GGUF tokenizer is malformed "
                             f"({type(e).__name__}: {first_line(e)})") from None
