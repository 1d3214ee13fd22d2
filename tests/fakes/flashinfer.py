"""Fake `flashinfer` (0.6/0.7): the paged decode and prefill wrappers with the real plan/run contract
(docs/gpu-contracts.md §3) and reference attention instead of JIT-compiled CUDA. Accepts CPU tensors.
Every plan/run is appended to `calls`."""
from __future__ import annotations

import torch

from fakes.reference import dense_attention, gather_sequence

__version__ = "0.7.4+fake"
calls: list[tuple[str, dict]] = []

SUPPORTED_HEAD_DIMS = (64, 128, 256)
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _dtype(value) -> torch.dtype:
    return _DTYPES[value] if isinstance(value, str) else value


def _check_csr(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> None:
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _check(indptr.dim() == 1 and indptr.numel() == last_page_len.numel() + 1,
           "indptr must have batch_size + 1 entries")
    _check(int(indptr[0]) == 0 and bool((indptr[1:] >= indptr[:-1]).all()), "indptr must start at 0 and not decrease")
    _check(int(indptr[-1]) == indices.numel(), "indptr[-1] must equal len(indices)")
    _check(bool(((last_page_len >= 1) & (last_page_len <= page_size)).all()), "last_page_len must be in [1, page_size]")
    _check(bool((indptr[1:] > indptr[:-1]).all()), "every request needs at least one page")


def _check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    _check(head_dim in SUPPORTED_HEAD_DIMS, f"Unsupported head_dim: {head_dim}")
    _check(num_qo_heads % num_kv_heads == 0, "num_qo_heads must be a multiple of num_kv_heads")


def _check_dtypes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    _check(q_dtype in (torch.float16, torch.bfloat16), f"Unsupported q_data_type {q_dtype}")
    _check(kv_dtype in (torch.float16, torch.bfloat16), f"Unsupported kv_data_type {kv_dtype}")


def _split_cache(paged_kv_cache, layout: str, page_size: int, num_kv_heads: int, head_dim: int):
    """(k, v) as NHD [max_pages, page_size, H_kv, D] from a tuple or a 5-D tensor, checking the shape."""
    if isinstance(paged_kv_cache, tuple):
        k, v = paged_kv_cache
    else:
        _check(paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2, "5-D paged_kv_cache must be (pages, 2, ...)")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    expected = (page_size, num_kv_heads, head_dim)
    _check(tuple(k.shape[1:]) == expected and k.shape == v.shape,
           f"paged_kv_cache shape {tuple(k.shape)} does not match the plan {expected}")
    return k, v


class _PagedWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        _check(float_workspace_buffer.dtype == torch.uint8, "workspace buffer must be uint8")
        _check(kv_layout in ("NHD", "HND"), f"Invalid kv_layout {kv_layout}")
        self.kv_layout = kv_layout
        self._plan = None

    def _store_plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                    page_size, q_data_type, kv_data_type, sm_scale, causal) -> None:
        _check_csr(indptr, indices, last_page_len, page_size)
        kv_lens = (page_size * (indptr[1:] - indptr[:-1] - 1) + last_page_len).tolist()
        q_dtype = _dtype(q_data_type)
        self._plan = {"qo": qo_indptr.tolist(), "kv_pages": indptr.tolist(), "indices": indices.to(torch.int64),
                      "kv_lens": kv_lens, "heads": (num_qo_heads, num_kv_heads, head_dim), "page_size": page_size,
                      "q_dtype": q_dtype, "kv_dtype": _dtype(kv_data_type) if kv_data_type else q_dtype,
                      "scale": sm_scale if sm_scale is not None else head_dim ** -0.5, "causal": causal}

    def run(self, q: torch.Tensor, paged_kv_cache, *, return_lse: bool = False, **_: object) -> torch.Tensor:
        plan = self._plan
        _check(plan is not None, "plan() must be called before run()")
        calls.append((f"{type(self).__name__}.run", {"tokens": q.shape[0]}))
        num_qo_heads, num_kv_heads, head_dim = plan["heads"]
        _check(q.dtype == plan["q_dtype"], f"q dtype {q.dtype} differs from the planned {plan['q_dtype']}")
        _check(tuple(q.shape[1:]) == (num_qo_heads, head_dim) and q.shape[0] == plan["qo"][-1],
               f"q shape {tuple(q.shape)} does not match the plan")
        k, v = _split_cache(paged_kv_cache, self.kv_layout, plan["page_size"], num_kv_heads, head_dim)
        _check(k.dtype == plan["kv_dtype"], "kv dtype differs from the planned kv_data_type")
        _check(plan["indices"].numel() == 0 or int(plan["indices"].max()) < k.shape[0], "page index out of range")
        out = torch.empty_like(q)
        for b, kv_len in enumerate(plan["kv_lens"]):
            pages = plan["indices"][plan["kv_pages"][b]:plan["kv_pages"][b + 1]]
            q_lo, q_hi = plan["qo"][b], plan["qo"][b + 1]
            _check(q_hi - q_lo <= kv_len or not plan["causal"], "query longer than its KV with causal=True")
            keys, values = gather_sequence(k, pages, kv_len), gather_sequence(v, pages, kv_len)
            out[q_lo:q_hi] = dense_attention(q[q_lo:q_hi], keys, values, plan["scale"], plan["causal"]).to(q.dtype)
        return (out, None) if return_lse else out


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, **_: object) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, **_: object) -> None:
        calls.append(("BatchDecodeWithPagedKVCacheWrapper.plan", {"batch": indptr.numel() - 1}))
        _check_heads(num_qo_heads, num_kv_heads, head_dim)
        group = num_qo_heads // num_kv_heads
        _check(self.use_tensor_cores or group in CUDA_CORE_DECODE_GROUPS, f"Unsupported group_size: {group}")
        _check_dtypes(_dtype(q_data_type), _dtype(kv_data_type or q_data_type))
        qo_indptr = torch.arange(indptr.numel(), dtype=torch.int32)
        self._store_plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                         page_size, q_data_type, kv_data_type, sm_scale, causal=False)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", **_: object) -> None:
        super().__init__(float_workspace_buffer, kv_layout)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, head_dim_vo=None, custom_mask=None, causal=False,
             pos_encoding_mode="NONE", sm_scale=None, q_data_type="float16", kv_data_type=None,
             **_: object) -> None:
        calls.append(("BatchPrefillWithPagedKVCacheWrapper.plan", {"batch": qo_indptr.numel() - 1,
                                                                   "causal": causal}))
        _check(qo_indptr.dtype == torch.int32, f"qo_indptr must be int32, got {qo_indptr.dtype}")
        _check(qo_indptr.numel() == paged_kv_indptr.numel(), "qo_indptr and kv_indptr batch sizes differ")
        _check(head_dim_vo in (None, head_dim_qk), "fake flashinfer: head_dim_vo != head_dim_qk not modelled")
        _check_heads(num_qo_heads, num_kv_heads, head_dim_qk)
        _check_dtypes(_dtype(q_data_type), _dtype(kv_data_type or q_data_type))
        self._store_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim_qk, page_size, q_data_type, kv_data_type, sm_scale, causal)
