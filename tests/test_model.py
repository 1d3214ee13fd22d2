"""kvlab's Llama equals HF transformers' LlamaForCausalLM on random tiny checkpoints (fp32, 1e-4), both through
the cache-free reference forward and through the varlen `forward` + cache seam (chunked prefill and decode)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.checkpoints import SMALL, randomized_save
from helpers.lazy import LazyImport

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.loader import load_model
from kvlab.common.model import LlamaForCausalLM
from kvlab.common.presets import TINY_CONFIG
from kvlab.common.sequence import Sequence
from kvlab.common.tokenizer import ByteTokenizer

transformers = LazyImport("transformers", reason="transformers (dev extra) is the ground truth")

TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}   # small: positions < 64 span all three bands

HEADS_4_4 = {"num_attention_heads": 4, "num_key_value_heads": 4}
HEADS_8_2 = {"num_attention_heads": 8, "num_key_value_heads": 2}
HEADS_4_2 = {"num_attention_heads": 4, "num_key_value_heads": 2}
VARIANTS = {
    "mha-d64-untied": {**HEADS_4_4, "head_dim": 64},
    "gqa4-d64-tied": {**HEADS_8_2, "head_dim": 64, "tie_word_embeddings": True},
    "gqa2-d128-untied": {**HEADS_4_2, "head_dim": 128},
    "gqa4-d128-tied": {**HEADS_8_2, "head_dim": 128, "tie_word_embeddings": True},
    "llama3-rope": {**HEADS_4_2, "head_dim": 64, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE},
}


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.py


def hf_checkpoint(tmp_path, **overrides):
    """A random HF Llama with non-trivial weights (std 0.05, norms around 1), saved to tmp_path."""
    config = transformers.LlamaConfig(**{**SMALL, **overrides})
    return randomized_save(transformers.LlamaForCausalLM(config).eval(), tmp_path, seed=1234)


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids).logits.float()


def random_ids(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_forward_matches_hf(tmp_path, variant):
    hf = hf_checkpoint(tmp_path, **VARIANTS[variant])
    model, tokenizer = load_model(tmp_path)
    assert tokenizer is None  # no tokenizer.json in the directory
    ids = random_ids(2, 48, 320)
    expected = hf_logits(hf, ids)
    got = model.reference_forward(ids)
    assert expected.abs().max() > 0.5           # logits are not trivially small
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_forward_matches_hf(tmp_path, variant, dense_cache, step):
    """Two sequences of different lengths: a chunked prefill (chunks of 7 and the rest, one item skipping
    logits), then three decode steps; every logits row equals HF's at the same position."""
    hf = hf_checkpoint(tmp_path, **VARIANTS[variant])
    model, _ = load_model(tmp_path)
    full = [random_ids(1, 40, 320, seed=1)[0].tolist(), random_ids(1, 33, 320, seed=2)[0].tolist()]
    expected = [hf_logits(hf, torch.tensor([f]))[0] for f in full]
    prompts = [f[:-3] for f in full]
    seqs = [Sequence(i, str(i), p, 8) for i, p in enumerate(prompts)]
    cache = dense_cache(model, 64)

    chunk1 = step(model, cache, [BatchItem(seqs[0], 0, 7, needs_logits=False), BatchItem(seqs[1], 0, 30)])
    torch.testing.assert_close(chunk1, expected[1][29:30], atol=TOL, rtol=0)
    rest = seqs[0].num_tokens - 7
    chunk2 = step(model, cache, [BatchItem(seqs[0], 7, rest)])
    torch.testing.assert_close(chunk2, expected[0][36:37], atol=TOL, rtol=0)
    for k in range(3):   # teacher-forced decode steps for both sequences at once
        items = []
        for s, f in zip(seqs, full):
            s.append_token(f[s.num_tokens])
            items.append(BatchItem(s, s.num_tokens - 1, 1))
        logits = step(model, cache, items)
        rows = torch.stack([e[s.num_tokens - 1] for s, e in zip(seqs, expected)])
        torch.testing.assert_close(logits, rows, atol=TOL, rtol=0)


def test_llama3_scaling_changes_logits(tmp_path):
    """Guards the llama3 case above from passing vacuously: dropping the scaling must change the logits."""
    hf_checkpoint(tmp_path, **VARIANTS["llama3-rope"])
    model, _ = load_model(tmp_path)
    plain = LlamaForCausalLM(dataclasses.replace(model.config, rope_scaling=None))
    plain.load_state_dict(model.state_dict())
    ids = random_ids(1, 48, 320)
    assert (plain.reference_forward(ids) - model.reference_forward(ids)).abs().max() > 1e-2


def test_greedy_forward_equals_reference_loop(greedy_cached):
    """The tiny preset decodes the same tokens through the cache seam as by recomputing everything."""
    model, _ = load_model("tiny")
    prompts = [[1, 50, 60, 70, 80], [1, 99, 98]]
    got = greedy_cached(model, prompts, 12)
    for prompt, out in zip(prompts, got):
        ids = torch.tensor([prompt])
        for _ in range(12):
            ids = torch.cat([ids, model.reference_forward(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert out == ids[0, len(prompt):].tolist()


def test_tiny_preset_is_deterministic_per_seed():
    a, tok = load_model("tiny", seed=0)
    b, _ = load_model("tiny", seed=0)
    c, _ = load_model("tiny", seed=1)
    assert a.config == TINY_CONFIG and isinstance(tok, ByteTokenizer)
    ids = torch.tensor([tok.encode("hello world")])
    la, lb, lc = a.reference_forward(ids), b.reference_forward(ids), c.reference_forward(ids)
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


def test_kv_shape_and_param_count():
    model, _ = load_model("tiny")
    shape = model.kv_shape("bfloat16", "cpu")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.num_q_heads) == (4, 2, 64, 4)
    assert shape.dtype == "bfloat16" and shape.bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert model.kv_shape().dtype == "float32"
    assert sum(p.numel() for p in model.parameters()) == TINY_CONFIG.num_params


def test_bfloat16_model_tracks_fp32():
    fp32, _ = load_model("tiny")
    bf16, _ = load_model("tiny", dtype="bfloat16")
    ids = random_ids(1, 32, 1024)
    ref = fp32.reference_forward(ids)
    got = bf16.reference_forward(ids)
    assert got.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(1024)
    ids = tok.encode("héllo, wörld")
    assert ids[0] == tok.bos_token_id and all(3 <= i < 259 for i in ids[1:])
    assert tok.decode(ids) == "héllo, wörld"
    assert tok.decode([tok.eos_token_id, 3 + ord("a"), 900]) == "a\ufffd"
