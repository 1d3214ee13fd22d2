"""Dense causal attention with past context, computed in float64 one sequence at a time: the ground truth."""
from __future__ import annotations

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool = True) -> torch.Tensor:
    """q [n, H, D] holds the last n positions of a sequence whose keys/values are k, v [S, H_kv, D]
    (causal: bottom-right aligned, as flash-attn and FlashInfer define it)."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    query_pos = torch.arange(k.shape[0] - n, k.shape[0])
    visible = torch.arange(k.shape[0])[None, :] <= query_pos[:, None]
    if causal:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64)


def gather_sequence(cache: torch.Tensor, blocks: list[int] | torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence from a paged cache [num_blocks, block_size, H_kv, D]."""
    blocks = torch.as_tensor(blocks, dtype=torch.int64)
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def paged_reference(q, k_cache, v_cache, block_tables, query_lens, context_lens, scale) -> torch.Tensor:
    """Reference output [T, H, D] (float64) of a varlen batch over a paged cache."""
    outs, start = [], 0
    for b, (n, ctx) in enumerate(zip(query_lens.tolist(), context_lens.tolist())):
        k = gather_sequence(k_cache, block_tables[b], ctx)
        v = gather_sequence(v_cache, block_tables[b], ctx)
        outs.append(dense_attention(q[start:start + n], k, v, scale))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=torch.float64)


def contiguous_reference(q, k_cache, v_cache, slots, query_lens, context_lens, scale) -> torch.Tensor:
    """Reference output [T, H, D] (float64) of a varlen batch over a contiguous cache [slots, max_len, H_kv, D]."""
    outs, start = [], 0
    for slot, n, ctx in zip(slots.tolist(), query_lens.tolist(), context_lens.tolist()):
        outs.append(dense_attention(q[start:start + n], k_cache[slot, :ctx], v_cache[slot, :ctx], scale))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=torch.float64)
