"""Tensor-parallel loading of an HF safetensors directory: each rank reads only its slices (safe_open
get_slice), and the shard equals the matching slices of the fully loaded model. A model with 4 KV heads:
per-rank KV bytes are exactly half at tp=2, and tp=2 generates tp=1's greedy tokens (slow: spawns)."""
from __future__ import annotations

import json

import pytest
import torch

from kvlab.common.dist.shard import SafetensorsReader, build_shard, shard_config
from kvlab.common.llm import LLM
from kvlab.common.loader import load_model
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.model_config import ModelConfig
from kvlab.common.sampling_params import SamplingParams

CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                     num_kv_heads=4, head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from safetensors.torch import save_file
    path = tmp_path_factory.mktemp("hf4kv")
    model = LlamaForCausalLM(CONFIG)
    model.init_random_weights(3)
    tensors = {name: p[first:first + rows].contiguous()
               for name, (p, first, rows) in model.hf_weight_targets().items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    return path


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_slices(hf_dir, rank):
    full, _ = load_model(str(hf_dir))
    reader = SafetensorsReader(hf_dir)
    shard = build_shard(CONFIG, rank, 2, reader, "float32", "cpu", group=None, timer=None)
    sliced = {name: dim for name, dim, *_ in reader.reads if dim is not None}
    assert len(sliced) == 7 * CONFIG.num_layers          # q k v o gate up down in every layer
    for name, dim, start, stop, shape in reader.reads:
        whole = reader.where[name].get_slice(name).get_shape()
        if dim is not None:
            assert shape[dim] * 2 == whole[dim] and stop - start == shape[dim]
    h, kv, d, i = CONFIG.num_heads * 16 // 2, CONFIG.num_kv_heads * 16 // 2, 128, 128
    mine = [slice(rank * h, (rank + 1) * h), slice(rank * kv, (rank + 1) * kv)]
    for layer_full, layer in zip(full.layers, shard.layers):
        q, k, v = layer_full.self_attn.qkv_proj.weight.split((2 * h, 2 * kv, 2 * kv))
        expected = torch.cat((q[mine[0]], k[mine[1]], v[mine[1]]))
        assert torch.equal(layer.self_attn.qkv_proj.weight, expected)
        assert torch.equal(layer.self_attn.o_proj.linear.weight,
                           layer_full.self_attn.o_proj.weight[:, rank * h:(rank + 1) * h])
        assert torch.equal(layer.mlp.down_proj.linear.weight,
                           layer_full.mlp.down_proj.weight[:, rank * i:(rank + 1) * i])
        assert layer.mlp.gate_up_proj.weight.shape == (2 * i, d)
    assert torch.equal(shard.lm_head.weight, full.lm_head.weight)        # replicated
    assert shard_config(CONFIG, 2).num_kv_heads == 2


@pytest.mark.slow
def test_tp2_on_hf_dir_halves_kv_bytes_and_matches_tp1(hf_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    kw = {"model": str(hf_dir), "backend": "vmm", "kv_cache_bytes": 2 * 1024**2, "page_size": 4096}
    with LLM(**kw) as one:
        tokens1 = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        bytes1 = one.engine.cache.shape.bytes_per_token
        reserved1 = one.cache_stats().reserved_bytes
    with LLM(tensor_parallel_size=2, **kw) as two:
        tokens2 = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
        infos = two.engine.runner.rank_infos()
    assert tokens2 == tokens1
    assert [i["bytes_per_token"] * 2 for i in infos] == [bytes1, bytes1]
    assert [i["reserved_bytes"] * 2 for i in infos] == [reserved1, reserved1]
