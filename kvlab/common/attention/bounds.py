"""Bounds checks on a step's metadata against the caches it indexes, run before a fallback kernel.

A kernel that raises may have raised on bad metadata (a block id past the pool, a slot past the cache), and
the next kernel in line may have no bounds checks at all (the Triton kernel reads wherever a block table points).
So before any fallback runs, the metadata is checked: an error here is the backend's, not the kernel's, and
stops the step instead of moving to another kernel.
"""
from __future__ import annotations

import torch

from kvlab.common.attention.metadata import AttentionMetadata, ContiguousMetadata, PagedMetadata
from kvlab.common.errors import KvlabError


class MetadataError(KvlabError, IndexError):
    """A step's attention metadata points outside the KV cache (a backend bug, not a kernel failure)."""


def check_metadata(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise MetadataError if any kernel could read outside `k_cache` (or `q`) by following `meta`."""
    problem = common_problem(meta, q)
    if problem is None and isinstance(meta, PagedMetadata):
        problem = paged_problem(meta, k_cache)
    if problem is None and isinstance(meta, ContiguousMetadata):
        problem = contiguous_problem(meta, k_cache)
    if problem is not None:
        raise MetadataError(f"attention metadata: {problem}; no kernel runs on it (the backend's prepare is wrong)")


def first_bad(bad: torch.Tensor) -> int | None:
    """Index of the first True of a 1-d mask, or None."""
    hits = bad.nonzero()
    return int(hits[0, 0]) if hits.numel() else None


def common_problem(meta: AttentionMetadata, q: torch.Tensor) -> str | None:
    batch = int(meta.query_lens.shape[0])
    cu = meta.cu_query_lens.long()
    if cu.shape[0] != batch + 1 or int(cu[-1]) != q.shape[0] or int(cu[0]) != 0:
        return f"cu_query_lens {cu.tolist()} does not cover the {q.shape[0]} query tokens of {batch} items"
    b = first_bad((cu[1:] - cu[:-1] != meta.query_lens.long()) | (meta.context_lens < meta.query_lens)
                  | (meta.query_lens < 0))
    if b is not None:
        return (f"item {b} has {int(meta.query_lens[b])} query tokens and context {int(meta.context_lens[b])} "
                f"(cu_query_lens {cu.tolist()})")
    return None


def paged_problem(meta: PagedMetadata, k_cache: torch.Tensor) -> str | None:
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    tables, contexts = meta.block_tables, meta.context_lens.long()
    needed = (contexts + block_size - 1) // block_size
    if tables.shape[0] != contexts.shape[0] or (needed.numel() and int(needed.max()) > tables.shape[1]):
        return (f"block tables of shape {list(tables.shape)} cannot hold contexts {contexts.tolist()} "
                f"in blocks of {block_size}")
    used = torch.arange(tables.shape[1], device=tables.device)[None, :] < needed[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    b = first_bad(bad.any(dim=1))
    if b is not None:
        return f"item {b}'s block table {tables[b][used[b]].tolist()} leaves the pool of {num_blocks} blocks"
    slots = meta.slot_mapping
    if slots is not None:
        t = first_bad((slots < 0) | (slots >= num_blocks * block_size))
        if t is not None:
            return f"token {t}'s slot {int(slots[t])} is outside the pool of {num_blocks * block_size} slots"
    return None


def contiguous_problem(meta: ContiguousMetadata, k_cache: torch.Tensor) -> str | None:
    num_slots, max_len = k_cache.shape[0], k_cache.shape[1]
    slots, contexts = meta.slots.long(), meta.context_lens.long()
    if slots.shape != contexts.shape:
        return f"{slots.shape[0]} slots for {contexts.shape[0]} items"
    b = first_bad((slots < 0) | (slots >= num_slots))
    if b is not None:
        return f"item {b}'s slot {int(slots[b])} is outside the cache's {num_slots} slots"
    readable = contexts if meta.readable_lens is None else meta.readable_lens.long()
    b = first_bad((contexts > readable) | (readable > max_len))
    if b is not None:
        return (f"item {b} has context {int(contexts[b])} and readable length {int(readable[b])} "
                f"in rows of {max_len} tokens")
    return None
