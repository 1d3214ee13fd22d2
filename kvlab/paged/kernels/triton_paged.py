"""Triton paged attention for decode and for prefill with past context (one kernel, causal, GQA).

Grid (sequence, kv head, query tile). A program owns BLOCK_Q query tokens times the GQA group of one KV
head, flattened to BLOCK_Q * GROUP_PAD rows, and walks the sequence's keys in tiles of TILE_N tokens,
looking up each key's block in the block table (any block size, ids in int64). Online softmax in fp32.
Written to compile on NVIDIA GPUs (every dot dimension >= 16, head_dim padded to a power of two and masked)
and to run under TRITON_INTERPRET=1, where `tl.dot` on bf16 multiplies raw bits: operands are cast to fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.common.attention.metadata import PagedMetadata
from kvlab.common.attention.triton_tiles import TILE_N, head_pad, tiling


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, cu_query_ptr, context_lens_ptr, scale, k_scale, v_scale, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile_first = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(cu_query_ptr + seq)
    q_len = tl.load(cu_query_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = tile_first + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx - q_len + tok
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)   # finite: rows with no visible key stay NaN-free
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)

    # keys up to the tile's last query position; an empty tile (past q_len) loops zero times
    last_tok = tl.minimum(tile_first + BLOCK_Q, q_len)
    kv_end = tl.where(tile_first < q_len, ctx - q_len + last_tok, 0)
    cols = tl.arange(0, TILE)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_start = 0
    if HAS_WINDOW:   # sliding window: keys before the tile's first query position - window + 1 are never read
        kv_start = tl.maximum(ctx - q_len + tile_first - window + 1, 0) // TILE * TILE
    for start in range(kv_start, kv_end, TILE):
        key_pos = start + cols
        key_ok = key_pos < kv_end
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = (key_pos % BLOCK_SIZE).to(tl.int64)
        k_base = block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_base[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        k = k.to(tl.float32)
        if KV_FP8:   # fp8 KV: dequantised via fp32, as vLLM's unified attention does
            k = k * k_scale
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_base = block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_base[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        v = v.to(tl.float32)
        if KV_FP8:
            v = v * v_scale
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedMetadata, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    q = q.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "K/V caches need a contiguous last dim"
    group = num_heads // num_kv_heads
    block_q, group_pad = tiling(group, meta.is_decode)
    grid = (len(meta.query_lens), num_kv_heads, triton.cdiv(meta.max_query_len, block_q))
    block_tables = meta.block_tables.contiguous()
    fp8 = meta.kv_fp8
    if fp8 is not None:   # the cache's uint8 bytes, read as the fp8 format they hold
        k_cache, v_cache = k_cache.view(fp8), v_cache.view(fp8)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, meta.cu_query_lens, meta.context_lens, scale,
        float(meta.k_scale), float(meta.v_scale), int(meta.sliding_window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        D_PAD=head_pad(head_dim), BLOCK_SIZE=block_size, TILE=TILE_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8 is not None,
        HAS_WINDOW=meta.sliding_window is not None,
    )
    return out
