"""A prefill step then a decode step through a KV cache's attention, against fp32 causal SDPA: the GPU check's
vmm_cache part and tests/test_gpu.py share it."""
from __future__ import annotations

from collections.abc import Sequence as Lengths
from typing import Any


def prefill_then_decode(cache: Any, prompt_lens: Lengths[int], seed: int = 0) -> list[list[tuple[Any, Any]]]:
    """One sequence per prompt length, prefilled then decoded one token, through `cache` (layer 0) on random
    q/k/v in the cache's compute dtype. Per step, per sequence: (the cache's output, fp32 causal SDPA over the
    sequence's whole history of the same rounded K/V), both fp32."""
    import torch

    from kvlab.common.attention.metadata import BatchItem
    from kvlab.common.sequence import Sequence
    shape = cache.shape
    g = torch.Generator(device=shape.device).manual_seed(seed)
    seqs = [Sequence(i, str(i), [1] * n, 4) for i, n in enumerate(prompt_lens)]
    history: dict[int, tuple[list, list]] = {s.seq_id: ([], []) for s in seqs}
    steps = [[BatchItem(s, 0, s.num_tokens) for s in seqs], [BatchItem(s, s.num_tokens, 1) for s in seqs]]
    results = []
    for items in steps:
        for it in items:
            cache.allocator.allocate(it.seq, it.context_len)
        meta = cache.storage.prepare(items)
        total = sum(it.num_tokens for it in items)
        q, k, v = (torch.randn(total, h, shape.head_dim, generator=g, device=shape.device).to(shape.torch_dtype)
                   for h in (shape.num_q_heads, shape.num_kv_heads, shape.num_kv_heads))
        out = cache.storage.attention(0, q, k, v, meta, shape.head_dim ** -0.5)
        results.append(compare_step(items, out, q, k, v, history, shape.head_dim ** -0.5))
    return results


def compare_step(items: list, out: Any, q: Any, k: Any, v: Any, history: dict, scale: float) -> list[tuple]:
    """Each item's slice of `out` beside its reference; appends the step's K/V to the history and advances
    each sequence to its context length."""
    import torch
    pairs, start = [], 0
    for it in items:
        n = it.num_tokens
        keys, values = history[it.seq.seq_id]
        keys.append(k[start:start + n])
        values.append(v[start:start + n])
        expected = causal_reference(q[start:start + n], torch.cat(keys), torch.cat(values), scale)
        pairs.append((out[start:start + n].float(), expected))
        start += n
        it.seq.num_computed_tokens = it.context_len
    return pairs


def causal_reference(q: Any, k: Any, v: Any, scale: float) -> Any:
    """q [n, H, D] = the last n positions over k, v [ctx, H_kv, D]; fp32, bottom-right causal."""
    import torch
    import torch.nn.functional as F
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
