"""max_model_len's default comes from the model (its max_position_embeddings, as in vLLM), capped by the tokens
the KV budget holds, with one warning line when the budget is the cap; an explicit value above the model's limit
stays an error. Through LLM(...), TOML and `kvlab generate`."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError, ModelLoadError
from kvlab.common.llm import LLM
from kvlab.common.loader import load_model, read_model_config
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import ModelConfig
from kvlab.common.presets import TINY_CONFIG
from kvlab.common.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
POSITIONS = 512
CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=POSITIONS)
TINY_TOKEN_BYTES = 4096                   # tiny: 4 layers x K,V x 2 heads x 64 x fp32
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf512(tmp_path_factory) -> Path:
    """An HF directory whose config.json says max_position_embeddings 512 (below the old default 1024), with a
    word-level tokenizer for `kvlab generate`."""
    from safetensors.torch import save_file
    path = tmp_path_factory.mktemp("hf512")
    model = LlamaForCausalLM(CONFIG)
    model.init_random_weights(1)
    save_file({name: p[first:first + rows].contiguous()
               for name, (p, first, rows) in model.hf_weight_targets().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-5, "max_position_embeddings": POSITIONS, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    import tokenizers as tk
    words = tk.Tokenizer(tk.models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]"))
    words.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    words.save(str(path / "tokenizer.json"))
    return path


def test_llm_takes_the_models_length_when_none_is_set(hf512):
    with LLM(model=str(hf512)) as llm:
        assert llm.config.max_model_len == POSITIONS
        assert llm.generate([[5] * (POSITIONS - 4)], GREEDY)[0].outputs[0].token_ids     # the full length runs


def test_an_explicit_length_above_the_models_stays_an_error(hf512):
    with pytest.raises(ConfigError) as info:
        LLM(model=str(hf512), max_model_len=2 * POSITIONS)
    assert str(info.value) == (f"max_model_len {2 * POSITIONS} exceeds the model's max_position_embeddings "
                               f"{POSITIONS}; lower max_model_len")


def test_an_explicit_length_within_the_models_is_kept(hf512):
    assert make_config(model=str(hf512), max_model_len=100).max_model_len == 100


def test_toml_without_max_model_len_takes_the_models(hf512, tmp_path):
    toml = tmp_path / "engine.toml"
    toml.write_text(f'model = "{hf512}"\nbackend = "vmm"\n')
    assert make_config(toml).max_model_len == POSITIONS
    toml.write_text(f'model = "{hf512}"\nmax_model_len = 64\n')
    assert make_config(toml).max_model_len == 64


@pytest.mark.parametrize("backend", ["paged", "vmm", "reserve"])
def test_the_kv_budget_caps_the_default_with_one_warning(backend, caplog):
    assert make_config(backend=backend).max_model_len == TINY_CONFIG.max_position_embeddings   # 64 MiB holds it
    with caplog.at_level(logging.WARNING, logger="kvlab.capacity"):
        llm = LLM(backend=backend, kv_cache_bytes=300 * TINY_TOKEN_BYTES, page_size=4096, block_size=16)
    with llm:
        stats = llm.cache_stats()
        held = stats.total_units * stats.tokens_per_unit
        assert llm.config.max_model_len <= 300 and held >= llm.config.max_model_len
        assert llm.generate([[5] * (llm.config.max_model_len - 4)], GREEDY)[0].outputs[0].token_ids
    lines = [r.getMessage() for r in caplog.records]      # reserve adds "at most 1 sequence(s) run at once"
    assert not [x for x in lines if "less than max_model_len" in x], lines    # the capped length always runs
    assert lines[0].startswith(f"{backend}: the KV budget holds {llm.config.max_model_len:,} tokens, less than "
                               f"the model's 4,096 positions") and "\n" not in lines[0]


def test_tensor_parallel_caps_by_one_ranks_cache():
    config = make_config(backend="vmm", kv_cache_bytes=300 * TINY_TOKEN_BYTES, page_size=4096,
                         tensor_parallel_size=2)
    assert 0 < config.max_model_len <= 300


def test_reading_a_models_header_fails_as_loading_it_does(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError) as header:
        read_model_config(missing)
    with pytest.raises(ModelLoadError) as load:
        load_model(missing)
    assert str(header.value) == str(load.value)
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        make_config(model=missing)


def test_kvlab_generate_takes_the_models_length(hf512):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "kvlab.experiments.cli.main", "generate", "--model", str(hf512),
                           "--max-tokens", "2", "--ignore-eos", "hello world"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "max_model_len" not in done.stderr


def test_kvlab_generate_under_a_small_budget_warns_once_and_refuses_the_long_request():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "kvlab.experiments.cli.main", "generate", "hi", "--kv-cache-bytes",
                           "64KiB", "--max-tokens", "40", "--ignore-eos"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 2, done.stderr
    assert "the KV budget holds 16 tokens, less than the model's 4,096 positions: max_model_len is 16" in lines[0]
    assert "exceeds max_model_len (16)" in lines[1]


def test_the_default_kv_budget_is_sized_from_the_model(monkeypatch):
    from kvlab.common import loader
    assert make_config().kv_cache_bytes == loader.DEFAULT_KV_FLOOR           # tiny: 4 x 4096 x 4 KiB = 64 MiB
    big = ModelConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=8192)   # SmolLM2-135M's shape
    monkeypatch.setattr(loader, "read_model_config", lambda name: big)
    from kvlab.common.machine import ram_bytes
    four_full_length = 4 * 8192 * (2 * 30 * 3 * 64 * 4)                       # 1.4 GiB of fp32 K and V
    expect = int(max(loader.DEFAULT_KV_FLOOR, min(four_full_length, loader.DEFAULT_KV_CEILING, ram_bytes() / 8)))
    config = make_config()
    assert config.kv_cache_bytes == expect > 64 * 2**20
    assert config.max_model_len == min(8192, config.kv_cache_bytes // (2 * 30 * 3 * 64 * 4))
    assert make_config(kv_cache_bytes=2**26).kv_cache_bytes == 2**26         # an explicit budget is kept
