"""flash-attn 2 over the contiguous cache, as vAttention runs it (flash-attn 2's KV-cache entry point):
`flash_attn_with_kvcache(q, K, V, cache_seqlens=..., cache_batch_idx=..., block_table=None, causal=True)`.
K/V for this step are already in the cache, so `cache_seqlens` is each sequence's full context and the kernel
reads only K[slot, :context_len] (bottom-right causal alignment = positions start..start+n-1)."""
from __future__ import annotations

import torch

from kvlab.common.attention.metadata import ContiguousMetadata


def contiguous_attention_flash_attn(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    meta: ContiguousMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache
    if q.shape[0] == 0:
        return torch.empty_like(q)
    seqlens = meta.context_lens.to(torch.int32)
    batch_idx = meta.slots.to(torch.int32)
    if meta.phase == "decode":   # one query per sequence: the whole batch in one call
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=seqlens,
                                      cache_batch_idx=batch_idx, softmax_scale=scale, causal=True)
        return out.squeeze(1)
    out = torch.empty_like(q)
    starts = meta.cu_query_lens.tolist()
    for b in range(len(starts) - 1):   # query lengths differ: one call per sequence
        lo, hi = starts[b], starts[b + 1]
        out[lo:hi] = flash_attn_with_kvcache(q[lo:hi].unsqueeze(0), k_cache, v_cache,
                                             cache_seqlens=seqlens[b:b + 1], cache_batch_idx=batch_idx[b:b + 1],
                                             softmax_scale=scale, causal=True)[0]
    return out
