"""Inputs for timing kvlab's Triton attention kernel (paged/kernels/triton_paged.py) on two layouts of the same
K/V, built on the device (host-drawn inputs would take minutes at these sizes):

- contiguous: each sequence's K/V is one row of [batch, context, H_kv, D], as a vmm slot holds it. The kernel
  sees it as blocks of `row` tokens (a power of two >= every context): block table [[0], [1], ...], so every
  key is read at `sequence * row stride + position` and the table lookup always hits entry 0 of its row;
- paged: the same K/V cut into blocks of `block_size` tokens stored at a random permutation of the pool, with
  the block table that finds them (what a paged cache gives the kernel).

Both run the same compiled code path apart from BLOCK_SIZE, so their time ratio is the cost of paging within
one kernel (scattered blocks, one table entry per block), not a difference between two implementations. The
row trick needs `row` tokens of addressable storage past the last sequence: a tail pad that is never read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.common.attention.metadata import PagedMetadata


@dataclass(frozen=True, slots=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


LLAMA3_8B_BF16 = Shape(32, 8, 128, "bfloat16")      # one layer of one rank
TINY_FP32 = Shape(4, 2, 64, "float32")              # the CPU dry run (the interpreter)


@dataclass(slots=True)
class Layouts:
    """One batch's queries and K/V [batch, context, H_kv, D], ready to be laid out either way."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    queries: int
    scale: float


def make_inputs(shape: Shape, batch: int, context: int, queries: int, device: str, row: int,
                seed: int = 0) -> Layouts:
    """Random q and K/V with `row - context` tokens of tail pad (see the module doc)."""
    g = torch.Generator(device=device).manual_seed(seed)
    per_token = shape.num_kv_heads * shape.head_dim
    dt = shape.torch_dtype()

    def kv() -> torch.Tensor:
        flat = torch.randn(batch * context * per_token + (row - context) * per_token, generator=g, device=device,
                           dtype=torch.float32 if device == "cpu" else dt).to(dt)
        return flat.as_strided((batch, context, shape.num_kv_heads, shape.head_dim),
                               (context * per_token, per_token, shape.head_dim, 1))
    q = torch.randn(batch * queries, shape.num_heads, shape.head_dim, generator=g, device=device,
                    dtype=torch.float32 if device == "cpu" else dt).to(dt)
    return Layouts(q, kv(), kv(), queries, shape.head_dim ** -0.5)


def metadata(batch: int, context: int, queries: int, tables: torch.Tensor, block_size: int) -> PagedMetadata:
    """What the kernel reads: every sequence has `context` tokens, its last `queries` of them new this step."""
    device = tables.device
    i32 = dict(dtype=torch.int32, device=device)
    positions = (torch.arange(queries, device=device) + context - queries).repeat(batch)
    return PagedMetadata(items=[], input_positions=positions, query_lens=torch.full((batch,), queries, **i32),
                         context_lens=torch.full((batch,), context, **i32),
                         cu_query_lens=torch.arange(0, batch * queries + 1, queries, **i32),
                         max_query_len=queries, max_context_len=context,
                         logits_indices=torch.arange(queries - 1, batch * queries, queries, device=device),
                         block_tables=tables.to(torch.int32), slot_mapping=torch.empty(0, dtype=torch.int64,
                                                                                       device=device),
                         block_size=block_size)


def contiguous_view(t: torch.Tensor, row: int) -> torch.Tensor:
    """[batch, context, H, D] seen as [batch, row, H, D]: same strides, reads stay inside each context."""
    return t.as_strided((t.shape[0], row, *t.shape[2:]), t.stride())


def contiguous_call(x: Layouts, row: int) -> Any:
    """The kernel over the contiguous layout (one block of `row` tokens per sequence)."""
    from kvlab.paged.kernels.triton_paged import paged_attention_triton
    batch, context = x.k.shape[0], x.k.shape[1]
    tables = torch.arange(batch, device=x.q.device).view(batch, 1)
    meta = metadata(batch, context, x.queries, tables, row)
    k, v = contiguous_view(x.k, row), contiguous_view(x.v, row)
    return lambda: paged_attention_triton(x.q, k, v, meta, x.scale)


def paged_call(x: Layouts, block_size: int, seed: int = 1) -> Any:
    """The kernel over the same K/V in blocks of `block_size` at shuffled places in a pool."""
    from kvlab.paged.kernels.triton_paged import paged_attention_triton
    batch, context = x.k.shape[0], x.k.shape[1]
    if context % block_size:
        raise ValueError(f"context {context} is not a multiple of the block size {block_size}")
    per_seq = context // block_size
    g = torch.Generator(device=x.q.device).manual_seed(seed)
    perm = torch.randperm(batch * per_seq, generator=g, device=x.q.device)
    k_pool, v_pool = (scatter_blocks(t, perm, block_size) for t in (x.k, x.v))
    meta = metadata(batch, context, x.queries, perm.view(batch, per_seq), block_size)
    return lambda: paged_attention_triton(x.q, k_pool, v_pool, meta, x.scale)


def scatter_blocks(t: torch.Tensor, perm: torch.Tensor, block_size: int) -> torch.Tensor:
    """Logical block j of the flattened [batch * context] tokens stored at pool block perm[j]."""
    blocks = t.reshape(-1, block_size, *t.shape[2:])
    pool = torch.empty_like(blocks)
    pool[perm] = blocks
    return pool
