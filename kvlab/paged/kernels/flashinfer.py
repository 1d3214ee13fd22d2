"""FlashInfer over the paged cache: BatchDecode/BatchPrefill paged wrappers fed a CSR page table
(`kv_indptr`, `kv_indices`, `kv_last_page_len`, all int32) built from kvlab's block tables (FlashInfer's
paged-KV format). FlashInfer plans once per batch and runs per layer, so the adapter plans when it sees a new
metadata object and reuses the plan for the other layers of the step. Imported lazily.

Decode uses CUDA cores when FlashInfer has a kernel for the GQA group ({1, 2, 3, 4, 6, 8}) and tensor
cores otherwise (any group), as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.common.attention.metadata import PagedMetadata, kernel_workspace

WORKSPACE_BYTES = 128 * 1024 * 1024
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8)


@dataclass(slots=True)
class PageTableCSR:
    kv_indptr: torch.Tensor          # int32 [B + 1], host
    kv_indices: torch.Tensor         # int32 [kv_indptr[-1]], on the cache device
    kv_last_page_len: torch.Tensor   # int32 [B] in [1, page_size], host


def block_tables_to_csr(block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int) -> PageTableCSR:
    """Flatten each row's first ceil(len / page_size) block ids, in order (no Python loop per sequence)."""
    lengths = context_lens.to(torch.int64)
    num_pages = (lengths + page_size - 1) // page_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < num_pages[:, None]
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(num_pages.cpu(), 0, dtype=torch.int32)
    last = (lengths - (num_pages - 1) * page_size).to(torch.int32).cpu()
    return PageTableCSR(indptr, block_tables[used].to(torch.int32), last)


def paged_attention_flashinfer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               meta: PagedMetadata, scale: float) -> torch.Tensor:
    """Plans once per step (the plan is kept in `meta.plans` for the other layers) and runs per layer."""
    import flashinfer
    if q.shape[0] == 0:
        return torch.empty_like(q)
    wrapper = meta.plans.get("flashinfer")
    if wrapper is None:
        wrapper = meta.plans["flashinfer"] = _plan(flashinfer, q, k_cache, meta, scale)
    return wrapper.run(q, (k_cache, v_cache))


def _plan(flashinfer, q, k_cache, meta: PagedMetadata, scale: float):
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    csr = block_tables_to_csr(meta.block_tables, meta.context_lens, page_size)
    buffers = kernel_workspace(meta)
    key = ("flashinfer.workspace", q.device)
    if key not in buffers:   # zeroed once per cache and device, as FlashInfer requires
        buffers[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    workspace = buffers[key]
    dtypes = {"q_data_type": q.dtype, "kv_data_type": k_cache.dtype, "sm_scale": scale}
    if meta.is_decode:
        tensor_cores = num_heads // num_kv_heads not in CUDA_CORE_DECODE_GROUPS
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                use_tensor_cores=tensor_cores)
        wrapper.plan(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, num_heads, num_kv_heads,
                     head_dim, page_size, **dtypes)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(meta.cu_query_lens.to(torch.int32).cpu(), csr.kv_indptr, csr.kv_indices,
                     csr.kv_last_page_len, num_heads, num_kv_heads, head_dim, page_size, causal=True, **dtypes)
    return wrapper

