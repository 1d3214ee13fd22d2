"""torch FlexAttention over the paged cache: the whole pool is one long KV sequence and a mask_mod maps each
physical slot back to (sequence, logical position) through an inverse block table, so a query sees exactly the
slots of its own sequence at positions <= its own (FlexAttention's mask_mod over the pool).

The block mask is built once per step (metadata object) and reused by every layer. On CUDA the attention is
torch.compile'd (a fused Triton kernel that skips masked KV tiles); on CPU it runs eagerly, which torch warns
materialises scores over the whole pool: correct, for tests and small pools only.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from kvlab.common.attention.metadata import PagedMetadata, kernel_workspace

MASK_BLOCK = 128


def inverse_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                         num_blocks: int) -> torch.Tensor:
    """int32 [B, num_blocks]: logical index of each physical block in each sequence's table, -1 if absent."""
    batch, width = block_tables.shape
    inverse = torch.full((batch, num_blocks), -1, dtype=torch.int32, device=block_tables.device)
    logical = torch.arange(width, device=block_tables.device).expand(batch, width)
    used = logical < ((context_lens.to(torch.int64) + block_size - 1) // block_size)[:, None]
    rows = torch.arange(batch, device=block_tables.device)[:, None].expand(batch, width)
    inverse[rows[used], block_tables[used].to(torch.int64)] = logical[used].to(torch.int32)
    return inverse


def paged_block_mask(meta: PagedMetadata, num_blocks: int, device: torch.device) -> BlockMask:
    block_size = meta.block_size
    inverse = inverse_block_tables(meta.block_tables, meta.context_lens, block_size, num_blocks)
    query_seq = torch.repeat_interleave(torch.arange(len(meta.query_lens), device=device),
                                        meta.query_lens.to(torch.int64))
    query_pos = meta.input_positions

    def mask_mod(b, h, q_idx, kv_idx):
        logical = inverse[query_seq[q_idx], kv_idx // block_size]
        return (logical >= 0) & (logical * block_size + kv_idx % block_size <= query_pos[q_idx])

    return create_block_mask(mask_mod, 1, None, meta.num_tokens, num_blocks * block_size, device=device,
                             BLOCK_SIZE=MASK_BLOCK)


def paged_attention_flex(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: PagedMetadata, scale: float) -> torch.Tensor:
    """The block mask is built once per step (kept in `meta.plans`) and reused by every layer."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    block_mask = meta.plans.get("flex")
    if block_mask is None:
        block_mask = meta.plans["flex"] = paged_block_mask(meta, k_cache.shape[0], q.device)
    keys = k_cache.view(-1, *k_cache.shape[2:]).transpose(0, 1).unsqueeze(0)
    values = v_cache.view(-1, *v_cache.shape[2:]).transpose(0, 1).unsqueeze(0)
    out = _attention(meta, q.device)(q.transpose(0, 1).unsqueeze(0), keys, values,
                                     block_mask=block_mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _attention(meta: PagedMetadata, device: torch.device):
    """Eager flex on CPU; on CUDA a torch.compile'd flex kept in the cache's kernel workspace."""
    if device.type != "cuda":
        return flex_attention
    workspace = kernel_workspace(meta)
    if "flex.compiled" not in workspace:
        workspace["flex.compiled"] = torch.compile(flex_attention, dynamic=True)
    return workspace["flex.compiled"]
