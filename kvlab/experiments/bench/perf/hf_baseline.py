"""The baseline a CPU user would reach for: HF transformers `generate` on the SAME weights as kvlab's model.

`to_hf` builds an HF LlamaConfig from a kvlab ModelConfig and loads kvlab's parameters into an HF
LlamaForCausalLM (the fused q|k|v and gate|up rows split back into HF's tensors), then checks the two models'
logits agree, so the comparison is model for model. `static_batches` serves requests the way `generate` can:
fixed batches, prompts left-padded to the batch's longest, every row decoded to the batch's longest output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvlab.common.errors import ModelLoadError
from kvlab.common.model import LlamaForCausalLM

PAD_ID = 0
PARITY_ATOL = 1e-3   # fp32 logits of the same weights, different kernels


def hf_config(model: LlamaForCausalLM):
    import transformers
    c = model.config
    if c.rope_scaling is not None:
        raise ModelLoadError("the HF baseline covers plain RoPE only; use the tiny preset")
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_position_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=PAD_ID, hidden_act="silu",
        attention_bias=False, mlp_bias=False, attn_implementation="sdpa")


def to_hf(model: LlamaForCausalLM):
    """An HF LlamaForCausalLM holding exactly `model`'s weights (fp32, eval mode), parity-checked."""
    import transformers
    transformers.logging.set_verbosity_error()
    hf = transformers.LlamaForCausalLM(hf_config(model)).to(model.dtype).eval()
    state = {name: param[first:first + rows].detach().clone()
             for name, (param, first, rows) in model.hf_weight_targets().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(f"HF baseline weights do not line up: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}")
    check_parity(model, hf)
    return hf


def check_parity(model: LlamaForCausalLM, hf) -> float:
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits.float()
    ours = model.reference_forward(ids)
    err = float((ours - theirs).abs().max())
    if err > PARITY_ATOL:
        raise ModelLoadError(f"HF baseline logits differ from kvlab's by {err:.2e} (> {PARITY_ATOL}): not the "
                             "same model")
    return err


@dataclass(slots=True)
class StaticRun:
    seconds: float
    useful_tokens: int        # each request's own output length
    generated_tokens: int     # rows x steps, padding rows included
    batches: int


def static_batches(hf, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> StaticRun:
    """generate() over consecutive batches of `batch_size` requests, greedy; each batch runs until its
    longest output is done (min_new_tokens = max_new_tokens, so EOS cannot end a row early)."""
    useful = generated = batches = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        ids, mask = left_pad(batch)
        steps = max(lens)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, pad_token_id=PAD_ID)
        generated += (out.shape[1] - ids.shape[1]) * len(batch)
        useful += sum(lens)
        batches += 1
    return StaticRun(time.perf_counter() - start, useful, generated, batches)


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, p in enumerate(batch):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask
