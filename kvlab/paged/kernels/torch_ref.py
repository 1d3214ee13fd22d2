"""Reference paged attention in torch: gather each sequence's blocks by block table, then SDPA.

Decode items are batched (padded to the longest context and masked); every other item runs alone with a
causal mask offset by its past context. Gathers land in a grow-only scratch buffer: fresh tensors for every
call cost page faults and ran 2-3x slower on CPU when measured.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.common.attention.kv_quant import read_kv
from kvlab.common.attention.metadata import PagedMetadata, kernel_workspace


class GatherBuffer:
    """Scratch memory reused across calls, one flat tensor per (dtype, device), grown on demand."""

    def __init__(self) -> None:
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        flat = self._flat.get((dtype, device))
        if flat is None or flat.numel() < numel:
            with torch.inference_mode(False):   # an inference tensor could not be written outside inference mode
                flat = torch.empty(max(numel, 2 * (0 if flat is None else flat.numel())), dtype=dtype,
                                   device=device)
            self._flat[(dtype, device)] = flat
        return flat[:numel]


def gather_blocks(cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                  scratch: GatherBuffer) -> tuple[torch.Tensor, ...]:
    """K and V of `blocks` [B, n] as [B, n * block_size, H_kv, D] views into the scratch buffer."""
    per_block = cache[0].numel()
    count = blocks.numel()
    flat = scratch.take(2 * count * per_block, cache.dtype, cache.device)
    out = []
    for source, part in ((cache, flat[:count * per_block]), (v_cache, flat[count * per_block:])):
        view = part.view(count, *cache.shape[1:])
        torch.index_select(source, 0, blocks.reshape(-1), out=view)
        out.append(view.view(blocks.shape[0], -1, *cache.shape[2:]))
    return tuple(out)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float, scratch: GatherBuffer, meta: PagedMetadata) -> torch.Tensor:
    """q [B, H, D], one query per sequence at its last position -> [B, H, D]."""
    block_size = k_cache.shape[1]
    num_blocks = -(-int(context_lens.max()) // block_size)
    k, v = read_kv(*gather_blocks(k_cache, v_cache, block_tables[:, :num_blocks], scratch), meta, q.dtype)
    keys = torch.arange(k.shape[1], device=q.device)
    mask = keys[None, :] < context_lens[:, None]
    if meta.sliding_window is not None:   # the query sits at context - 1: keys (context - 1 - W, context - 1]
        mask &= keys[None, :] >= context_lens[:, None] - meta.sliding_window
    mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prefill_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                 context_len: int, scale: float, scratch: GatherBuffer, meta: PagedMetadata) -> torch.Tensor:
    """q [n, H, D] for positions [context_len - n, context_len) of one sequence -> [n, H, D]."""
    k, v = read_kv(*gather_blocks(k_cache, v_cache, blocks[None], scratch), meta, q.dtype)
    keys = torch.arange(k.shape[1], device=q.device)
    query_pos = torch.arange(context_len - q.shape[0], context_len, device=q.device)
    mask = keys[None, :] <= query_pos[:, None]
    if meta.sliding_window is not None:
        mask &= keys[None, :] > query_pos[:, None] - meta.sliding_window
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: PagedMetadata, scale: float) -> torch.Tensor:
    if q.shape[0] == 0:
        return torch.empty_like(q)
    scratch = kernel_workspace(meta).setdefault("torch_paged.gather", GatherBuffer())
    if meta.is_decode:
        return _decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, scratch, meta)
    out = torch.empty_like(q)
    single = meta.query_lens == 1
    if bool(single.any()):
        rows = single.nonzero().squeeze(1)
        first = meta.cu_query_lens[rows].long()
        out[first] = _decode(q[first], k_cache, v_cache, meta.block_tables[rows], meta.context_lens[rows], scale,
                             scratch, meta)
    block_size = k_cache.shape[1]
    cu, ctx, qlens = meta.cu_query_lens.tolist(), meta.context_lens.tolist(), meta.query_lens.tolist()
    for b, n in enumerate(qlens):
        if n > 1:
            blocks = meta.block_tables[b, :-(-ctx[b] // block_size)]
            out[cu[b]:cu[b + 1]] = _prefill_one(q[cu[b]:cu[b + 1]], k_cache, v_cache, blocks, ctx[b], scale,
                                                 scratch, meta)
    return out
