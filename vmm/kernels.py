"""Contiguous attention kernels: no block tables, each sequence's K/V is row `slot` of [num_slots, max_len, H_kv, D].

A kernel may read only K[slot, :context_len] of each sequence: in the vmm cache the pages past a sequence's
length may be unmapped, and touching them is SIGSEGV (host) or a sticky illegal-address error (CUDA). So no
sequence is padded to max_len or to the batch's longest context; decode batches only sequences of equal length.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from common.kv_cache import ContiguousMetadata


def contiguous_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: ContiguousMetadata, scale: float) -> torch.Tensor:
    """torch SDPA over per-slot views, prefill (with past context, causal) and decode alike. -> [T, H, D]"""
    out = torch.empty_like(q)
    starts = meta.cu_query_lens.tolist()
    slots = meta.slots.tolist()
    contexts = meta.context_lens.tolist()
    single: dict[int, list[int]] = defaultdict(list)   # context length -> items with one query token
    for b, (slot, ctx) in enumerate(zip(slots, contexts)):
        lo, hi = starts[b], starts[b + 1]
        if hi - lo == 1:
            single[ctx].append(b)
        elif hi > lo:
            out[lo:hi] = _one_sequence(q[lo:hi], k_cache[slot, :ctx], v_cache[slot, :ctx], scale)
    for ctx, batch in single.items():
        rows = [starts[b] for b in batch]
        keys, values = _same_length_rows(k_cache, v_cache, [slots[b] for b in batch], ctx)
        attn = F.scaled_dot_product_attention(q[rows].unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                              scale=scale, enable_gqa=True)   # [B, H, 1, D]
        out[rows] = attn.squeeze(2)
    return out


def _one_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] at the last n positions of a context keys/values [ctx, H_kv, D]; causal, bottom-right."""
    n, ctx = q.shape[0], keys.shape[0]
    mask = None
    if n != ctx:
        past = ctx - n
        mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(past, ctx, device=q.device)[:, None]
    attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)
    return attn[0].transpose(0, 1)


def _same_length_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int],
                      ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, ctx, H_kv, D] K and V of slots that all hold exactly `ctx` tokens: a zero-copy view when the slots
    are consecutive, else a gather of exactly those rows (never a byte past any sequence's context)."""
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        return k_cache[first:first + len(slots), :ctx], v_cache[first:first + len(slots), :ctx]
    index = torch.tensor(slots, dtype=torch.int64, device=k_cache.device)
    return k_cache[:, :ctx].index_select(0, index), v_cache[:, :ctx].index_select(0, index)
