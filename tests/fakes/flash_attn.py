"""Fake `flash_attn` (2.8.x): the two entry points kvlab calls, with the checks of the real library
(docs/gpu-contracts.md §2) and reference attention instead of CUDA. Accepts CPU tensors.
Every call is appended to `calls` as (function name, keyword summary)."""
from __future__ import annotations

import torch

from fakes.reference import dense_attention, gather_sequence

__version__ = "2.8.3+fake"
calls: list[tuple[str, dict]] = []


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(k.shape[-1] == q.shape[-1], "key and query must have the same head dimension")
    _check(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")


def _check_block_table(block_table: torch.Tensor, k_cache: torch.Tensor) -> int:
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    page = k_cache.shape[1]
    _check(page % 256 == 0, "Paged KV cache block size must be divisible by 256")
    _check(block_table.numel() == 0 or int(block_table.max()) < k_cache.shape[0],
           "block_table holds an id past the end of the paged KV cache")
    return page


def _int32_vector(t: torch.Tensor, name: str) -> None:
    _check(t.dtype == torch.int32, f"{name} must have dtype int32")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    calls.append(("flash_attn_with_kvcache", {"paged": block_table is not None, "causal": causal,
                                              "batch_idx": cache_batch_idx is not None, "batch": q.shape[0],
                                              "seqlen_q": q.shape[1]}))
    _check(k is None and v is None, "fake flash_attn: appending k/v inside the kernel is not modelled")
    _check(q.dim() == 4, "q must be (batch, seqlen_q, nheads, headdim)")
    _check_qkv(q, k_cache, v_cache)
    batch = q.shape[0]
    if block_table is not None:
        _check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        _check(cache_leftpad is None, "Paged KVcache does not support cache_leftpad")
        capacity = block_table.shape[1] * _check_block_table(block_table, k_cache)
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            _int32_vector(cache_batch_idx, "cache_batch_idx")
            _check(cache_batch_idx.numel() == 0 or int(cache_batch_idx.max()) < k_cache.shape[0],
                   "cache_batch_idx out of range")
        else:
            _check(k_cache.shape[0] >= batch, "k_cache has fewer rows than the batch")
    if isinstance(cache_seqlens, int) or cache_seqlens is None:
        seqlens = [cache_seqlens or capacity] * batch
    else:
        _int32_vector(cache_seqlens, "cache_seqlens")
        seqlens = cache_seqlens.tolist()
    _check(max(seqlens, default=0) <= capacity, "cache_seqlens exceed the KV cache (or block table) capacity")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b, n in enumerate(seqlens):
        if block_table is not None:
            keys = gather_sequence(k_cache, block_table[b], n)
            values = gather_sequence(v_cache, block_table[b], n)
        else:
            row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
            keys, values = k_cache[row, :n], v_cache[row, :n]
        out[b] = dense_attention(q[b], keys, values, scale, causal).to(q.dtype)
    return out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    calls.append(("flash_attn_varlen_func", {"paged": block_table is not None, "causal": causal,
                                             "batch": cu_seqlens_q.shape[0] - 1}))
    _check(q.dim() == 3, "q must be (total_q, nheads, headdim)")
    _check_qkv(q, k, v)
    _check(q.shape[-1] % 8 == 0, "head dimension must be a multiple of 8 in varlen")
    _check(dropout_p == 0.0, "fake flash_attn: dropout is not modelled")
    _int32_vector(cu_seqlens_q, "cu_seqlens_q")
    _int32_vector(cu_seqlens_k, "cu_seqlens_k")
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    _check(len(q_lens) == len(k_lens), "cu_seqlens_q and cu_seqlens_k describe different batch sizes")
    _check(max(q_lens, default=0) <= max_seqlen_q and max(k_lens, default=0) <= max_seqlen_k,
           "max_seqlen_q/max_seqlen_k smaller than a sequence")
    if block_table is not None:
        capacity = block_table.shape[1] * _check_block_table(block_table, k)
        _check(block_table.shape[0] == len(q_lens), "block_table must have one row per sequence")
        _check(max(k_lens, default=0) <= capacity, "a KV length exceeds its block table capacity")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    q_start = cu_seqlens_q.tolist()
    k_start = cu_seqlens_k.tolist()
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        if block_table is not None:
            keys, values = gather_sequence(k, block_table[b], nk), gather_sequence(v, block_table[b], nk)
        else:
            keys, values = k[k_start[b]:k_start[b] + nk], v[k_start[b]:k_start[b] + nk]
        out[q_start[b]:q_start[b] + nq] = dense_attention(q[q_start[b]:q_start[b] + nq], keys, values,
                                                          scale, causal).to(q.dtype)
    return out
