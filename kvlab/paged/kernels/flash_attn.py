"""flash-attn 2 over the paged cache: `flash_attn_with_kvcache(block_table=...)` for decode and
`flash_attn_varlen_func(block_table=...)` for prefill with past context (flash-attn 2's two entry points).

The library wants fp16/bf16, int32 tables and cu_seqlens, head_dim <= 256 and a page size divisible by 256
(upstream; vLLM's fork allows 16): the registry declares those rules, the library enforces them. Imported
lazily so that kvlab runs where flash-attn is not installed.
"""
from __future__ import annotations

import torch

from kvlab.common.attention.metadata import PagedMetadata


def cumulative_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """[B] -> int32 [B + 1] prefix sums starting at 0."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0, dtype=torch.int32)
    return out


def paged_attention_flash_attn(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: PagedMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    if q.shape[0] == 0:
        return torch.empty_like(q)
    block_table = meta.block_tables.to(torch.int32).contiguous()
    context_lens = meta.context_lens.to(torch.int32)
    if meta.is_decode:
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                      block_table=block_table, softmax_scale=scale, causal=True)
        return out.squeeze(1)
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.cu_query_lens.to(torch.int32),
                                  cu_seqlens_k=cumulative_lengths(context_lens), max_seqlen_q=meta.max_query_len,
                                  max_seqlen_k=meta.max_context_len, softmax_scale=scale, causal=True,
                                  block_table=block_table)
