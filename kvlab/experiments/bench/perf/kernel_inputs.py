"""Random paged-attention inputs on any device, with a dense reference: for the GPU check and gpu tests.

Block ids are a shuffled permutation of the pool, so a kernel that ignores the block table fails. The
reference gathers each sequence's K/V and runs dense causal attention (bottom-right aligned) in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.common.attention.metadata import BatchItem, PagedMetadata, base_metadata
from kvlab.common.sequence import Sequence


@dataclass(slots=True)
class PagedCase:
    q: torch.Tensor            # [T, H, D]
    k_cache: torch.Tensor      # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor
    meta: PagedMetadata
    scale: float


def paged_case(query_lens: list[int], context_lens: list[int], block_size: int, num_heads: int,
               num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int = 0) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    items = [BatchItem(Sequence(i, str(i), [0] * c, 1), c - n, n)
             for i, (n, c) in enumerate(zip(query_lens, context_lens))]
    base = base_metadata(items, device)
    per_seq = [-(-c // block_size) for c in context_lens]
    perm = torch.randperm(sum(per_seq) + 1, generator=g).tolist()
    width, rows, used = max(per_seq), [], 0
    for n in per_seq:
        rows.append(perm[used:used + n] + [0] * (width - n))
        used += n
    tables = torch.tensor(rows, dtype=torch.int32)
    positions = base["input_positions"].cpu()
    owner = torch.repeat_interleave(torch.arange(len(items)), base["query_lens"].cpu().long())
    slots = tables[owner, positions // block_size].long() * block_size + positions % block_size
    meta = PagedMetadata(**base, block_tables=tables.to(device), slot_mapping=slots.to(device),
                         block_size=block_size)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
    k_cache = randn(len(perm), block_size, num_kv_heads, head_dim)
    v_cache = randn(len(perm), block_size, num_kv_heads, head_dim)
    return PagedCase(randn(sum(query_lens), num_heads, head_dim), k_cache, v_cache, meta, head_dim ** -0.5)


def sequence_kv(case: PagedCase, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [context, H_kv, D] of sequence b, gathered through its block table."""
    ctx = int(case.meta.context_lens[b])
    blocks = case.meta.block_tables[b, :-(-ctx // case.meta.block_size)].long()
    k = case.k_cache[blocks].reshape(-1, *case.k_cache.shape[2:])[:ctx]
    v = case.v_cache[blocks].reshape(-1, *case.v_cache.shape[2:])[:ctx]
    return k, v


def reference(case: PagedCase) -> torch.Tensor:
    """fp32 [T, H, D]: per sequence, causal attention of its queries over its gathered context."""
    cu = case.meta.cu_query_lens.tolist()
    out = torch.empty(case.q.shape, dtype=torch.float32, device=case.q.device)
    for b in range(len(cu) - 1):
        k, v = (t.float().transpose(0, 1)[None] for t in sequence_kv(case, b))
        q = case.q[cu[b]:cu[b + 1]].float().transpose(0, 1)[None]
        n, ctx = q.shape[2], k.shape[2]
        mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True)
        out[cu[b]:cu[b + 1]] = attn[0].transpose(0, 1)
    return out


def dense_decode_inputs(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For an all-decode case of equal contexts: q [B, H, 1, D] and K/V [B, H_kv, ctx, D] laid out densely, the
    contiguous layout a vmm cache gives SDPA without any gather."""
    ks, vs = zip(*(sequence_kv(case, b) for b in range(len(case.meta.items))))
    k = torch.stack(ks).transpose(1, 2).contiguous()
    v = torch.stack(vs).transpose(1, 2).contiguous()
    return case.q.unsqueeze(2), k, v
