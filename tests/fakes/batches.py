"""Random kernel inputs: a varlen batch over a paged cache with shuffled block tables, or over a contiguous
cache with shuffled slots, plus the float64 reference output."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fakes.reference import contiguous_reference, paged_reference
from kvlab.common.attention.metadata import BatchItem, ContiguousMetadata, PagedMetadata, base_metadata
from kvlab.common.sequence import Sequence


@dataclass(slots=True)
class KernelCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedMetadata | ContiguousMetadata
    scale: float
    expected: torch.Tensor   # float64 [T, H, D]


def _items(query_lens: list[int], context_lens: list[int]) -> list[BatchItem]:
    return [BatchItem(Sequence(i, str(i), [0] * c, 1), c - n, n)
            for i, (n, c) in enumerate(zip(query_lens, context_lens))]


def _randn(generator: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


def paged_case(query_lens: list[int], context_lens: list[int], block_size: int = 4, num_heads: int = 4,
               num_kv_heads: int = 2, head_dim: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
               spare_blocks: int = 3) -> KernelCase:
    """Block ids are a random permutation of the pool (plus spare blocks nobody uses); tables padded with 0."""
    g = torch.Generator().manual_seed(seed)
    items = _items(query_lens, context_lens)
    base = base_metadata(items)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_seq, default=0)
    rows, used = [], 0
    for n in blocks_per_seq:
        rows.append(perm[used:used + n] + [0] * (width - n))
        used += n
    block_tables = torch.tensor(rows, dtype=torch.int32).reshape(len(items), width)
    positions = base["input_positions"]
    seq_of_token = torch.repeat_interleave(torch.arange(len(items)), base["query_lens"].long())
    slots = block_tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    meta = PagedMetadata(**base, block_tables=block_tables, slot_mapping=slots, block_size=block_size)
    k_cache = _randn(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = _randn(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    q = _randn(g, sum(query_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected = paged_reference(q, k_cache, v_cache, block_tables, base["query_lens"], base["context_lens"], scale)
    return KernelCase(q, k_cache, v_cache, meta, scale, expected)


def contiguous_case(query_lens: list[int], context_lens: list[int], max_len: int = 64, num_heads: int = 4,
                    num_kv_heads: int = 2, head_dim: int = 64, dtype: torch.dtype = torch.float16,
                    seed: int = 0, spare_slots: int = 2) -> KernelCase:
    """Each item gets a random cache row (slot) out of len(items) + spare_slots."""
    g = torch.Generator().manual_seed(seed)
    items = _items(query_lens, context_lens)
    base = base_metadata(items)
    num_slots = len(items) + spare_slots
    slots = torch.randperm(num_slots, generator=g)[:len(items)]
    meta = ContiguousMetadata(**base, slots=slots)
    k_cache = _randn(g, num_slots, max_len, num_kv_heads, head_dim, dtype=dtype)
    v_cache = _randn(g, num_slots, max_len, num_kv_heads, head_dim, dtype=dtype)
    q = _randn(g, sum(query_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected = contiguous_reference(q, k_cache, v_cache, slots, base["query_lens"], base["context_lens"], scale)
    return KernelCase(q, k_cache, v_cache, meta, scale, expected)
