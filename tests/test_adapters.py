"""flash-attn and FlashInfer adapters against fakes that enforce the libraries' contracts (tests/fakes/)."""
import sys

import pytest
import torch
from fakes import install_fake
from fakes.batches import contiguous_case, paged_case

from kvlab.common.attention.dispatch import AttentionSpec, KernelDecl, build_dispatcher
from kvlab.common.attention.flash_attn_contiguous import contiguous_attention_flash_attn
from kvlab.common.errors import KernelUnavailable
from kvlab.paged.kernels import flashinfer as flashinfer_adapter
from kvlab.paged.kernels.flash_attn import paged_attention_flash_attn
from kvlab.paged.kernels.flashinfer import block_tables_to_csr, paged_attention_flashinfer

HALF = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
DECODE = ([1, 1, 1], [300, 40, 513])
PREFILL = ([1, 30, 7], [300, 40, 513])          # mixed: a decode item, a whole prompt, a chunk with context
FI_DECODE = ([1, 1, 1], [30, 16, 51])           # page 16: a partial, a full and a multi-page last page
FI_PREFILL = ([1, 12, 7], [30, 16, 51])


def error_of(out, case) -> float:
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return (out.double() - case.expected).abs().max().item()


@pytest.fixture
def flash_attn(monkeypatch):
    return install_fake(monkeypatch, "flash_attn")


@pytest.fixture
def flashinfer(monkeypatch):
    monkeypatch.setattr(flashinfer_adapter, "WORKSPACE_BYTES", 1024)   # the fake needs no 128 MiB workspace
    return install_fake(monkeypatch, "flashinfer")


# -- flash-attn, paged --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(HALF), ids=["fp16", "bf16"])
@pytest.mark.parametrize("lens", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_flash_attn_paged_matches_dense(flash_attn, lens, dtype):
    case = paged_case(*lens, block_size=256, head_dim=64, dtype=dtype)
    out = paged_attention_flash_attn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert error_of(out, case) < HALF[dtype]
    name, info = flash_attn.calls[-1]
    assert info["paged"] and info["causal"]
    assert name == ("flash_attn_with_kvcache" if lens is DECODE else "flash_attn_varlen_func")


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 16, "dtype": torch.float16}, "block size must be divisible by 256"),
    ({"block_size": 256, "dtype": torch.float32}, "only support fp16 and bf16"),
    ({"block_size": 256, "dtype": torch.float16, "head_dim": 512}, "head dimension at most 256"),
])
def test_flash_attn_paged_contract_violations_raise(flash_attn, kwargs, message):
    case = paged_case(*DECODE, **kwargs)
    with pytest.raises(RuntimeError, match=message):
        paged_attention_flash_attn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)


def test_fake_flash_attn_checks_tables_and_exclusive_arguments(flash_attn):
    case = paged_case(*DECODE, block_size=256, head_dim=64, dtype=torch.float16)
    q, lens = case.q.unsqueeze(1), case.meta.context_lens
    with pytest.raises(RuntimeError, match="block_table must have dtype torch.int32"):
        flash_attn.flash_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=lens,
                                           block_table=case.meta.block_tables.long())
    with pytest.raises(RuntimeError, match="Paged KVcache does not support cache_batch_idx"):
        flash_attn.flash_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=lens,
                                           block_table=case.meta.block_tables, cache_batch_idx=lens)
    with pytest.raises(RuntimeError, match="cache_seqlens exceed"):
        flash_attn.flash_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=lens + 1000,
                                           block_table=case.meta.block_tables)
    odd = paged_case(*PREFILL, block_size=256, head_dim=20, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="multiple of 8 in varlen"):
        paged_attention_flash_attn(odd.q, odd.k_cache, odd.v_cache, odd.meta, odd.scale)


def test_flash_attn_paged_empty_batch(flash_attn):
    case = paged_case([], [], block_size=256, head_dim=64, dtype=torch.float16)
    assert paged_attention_flash_attn(case.q, case.k_cache, case.v_cache, case.meta, case.scale).shape[0] == 0
    assert flash_attn.calls == []


# -- flash-attn, contiguous (vmm) ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(HALF), ids=["fp16", "bf16"])
@pytest.mark.parametrize("lens", [([1, 1, 1], [5, 64, 33]), ([1, 9, 4], [5, 9, 33])], ids=["decode", "prefill"])
def test_flash_attn_contiguous_matches_dense(flash_attn, lens, dtype):
    case = contiguous_case(*lens, max_len=64, dtype=dtype)
    out = contiguous_attention_flash_attn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert error_of(out, case) < HALF[dtype]
    kinds = {(info["paged"], info["batch"]) for _, info in flash_attn.calls}
    if lens[0] == [1, 1, 1]:
        assert kinds == {(False, 3)} and flash_attn.calls[0][1]["batch_idx"]   # one call via cache_batch_idx
    else:
        assert kinds == {(False, 1)} and len(flash_attn.calls) == 3            # one call per sequence


def test_flash_attn_contiguous_rejects_fp32(flash_attn):
    case = contiguous_case([1], [5], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        contiguous_attention_flash_attn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)


# -- FlashInfer ---------------------------------------------------------------------------------------------
def test_block_tables_to_csr():
    tables = torch.tensor([[4, 2, 9], [7, 0, 0], [1, 3, 0]], dtype=torch.int32)
    csr = block_tables_to_csr(tables, torch.tensor([9, 4, 5], dtype=torch.int32), page_size=4)
    assert csr.kv_indptr.tolist() == [0, 3, 4, 6]
    assert csr.kv_indices.tolist() == [4, 2, 9, 7, 1, 3]
    assert csr.kv_last_page_len.tolist() == [1, 4, 1]          # a full last page is page_size, never 0
    assert {t.dtype for t in (csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len)} == {torch.int32}


@pytest.mark.parametrize("dtype", list(HALF), ids=["fp16", "bf16"])
@pytest.mark.parametrize("lens", [FI_DECODE, FI_PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("heads", [(4, 2), (10, 2)], ids=["group2", "group5"])
def test_flashinfer_matches_dense(flashinfer, lens, dtype, heads):
    case = paged_case(*lens, block_size=16, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, dtype=dtype)
    out = paged_attention_flashinfer(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert error_of(out, case) < HALF[dtype]


def test_flashinfer_plans_once_per_step(flashinfer):
    case = paged_case(*FI_DECODE, block_size=16, head_dim=64, dtype=torch.float16)
    for _ in range(3):                                         # three layers of one step
        paged_attention_flashinfer(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    other = paged_case(*FI_PREFILL, block_size=16, head_dim=64, dtype=torch.float16)
    paged_attention_flashinfer(other.q, other.k_cache, other.v_cache, other.meta, other.scale)
    names = [name for name, _ in flashinfer.calls]
    assert names.count("BatchDecodeWithPagedKVCacheWrapper.plan") == 1
    assert names.count("BatchDecodeWithPagedKVCacheWrapper.run") == 3
    assert names.count("BatchPrefillWithPagedKVCacheWrapper.plan") == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"head_dim": 80, "dtype": torch.float16}, "Unsupported head_dim: 80"),
    ({"head_dim": 64, "dtype": torch.float32}, "Unsupported q_data_type"),
])
def test_flashinfer_contract_violations_raise(flashinfer, kwargs, message):
    case = paged_case(*FI_DECODE, block_size=16, **kwargs)
    with pytest.raises(RuntimeError, match=message):
        paged_attention_flashinfer(case.q, case.k_cache, case.v_cache, case.meta, case.scale)


def test_fake_flashinfer_cuda_core_decode_rejects_group_5(flashinfer):
    case = paged_case(*FI_DECODE, block_size=16, num_heads=10, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    csr = block_tables_to_csr(case.meta.block_tables, case.meta.context_lens, 16)
    workspace = torch.zeros(16, dtype=torch.uint8)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=False)
    with pytest.raises(RuntimeError, match="Unsupported group_size: 5"):
        wrapper.plan(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, 10, 2, 64, 16, q_data_type=torch.float16)
    with pytest.raises(RuntimeError, match="last_page_len must be in"):
        wrapper.plan(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len * 0, 4, 2, 64, 16)


# -- lazy import and runtime fallback through the dispatcher ------------------------------------------------
def test_adapters_import_without_their_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)      # `import flash_attn` raises ImportError
    case = paged_case(*DECODE, block_size=256, head_dim=64, dtype=torch.float16)
    with pytest.raises(ImportError):
        paged_attention_flash_attn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)


def _fallback_dispatcher(spec):
    decls = [KernelDecl("flash_attn_paged", "paged", "kvlab.paged.kernels.flash_attn:paged_attention_flash_attn"),
             KernelDecl("torch_paged", "paged", "kvlab.paged.kernels.torch_ref:paged_attention_torch")]
    return build_dispatcher(spec, decls, ["flash_attn_paged", "torch_paged"])


@pytest.mark.parametrize("installed, reason", [(True, "divisible by 256"), (False, "ModuleNotFoundError")])
def test_library_refusal_falls_back_to_torch_and_is_reported(monkeypatch, installed, reason):
    if installed:
        install_fake(monkeypatch, "flash_attn")
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
    spec = AttentionSpec("paged", "cpu", "float16", 64, 4, 2, block_size=16)
    dispatcher = _fallback_dispatcher(spec)
    case = paged_case(*DECODE, block_size=16, head_dim=64, dtype=torch.float16)
    out = dispatcher.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert error_of(out, case) < HALF[torch.float16]
    report = dispatcher.report()
    assert report["kernels"]["decode"] == "torch_paged" and report["calls"] == {"torch_paged": 1}
    (fallback,) = report["runtime_fallbacks"]
    assert fallback["kernel"] == "flash_attn_paged" and reason in fallback["reason"]


def test_no_kernel_left_is_a_clear_error(flash_attn):
    spec = AttentionSpec("paged", "cpu", "float16", 64, 4, 2, block_size=16)
    decls = [KernelDecl("flash_attn_paged", "paged", "kvlab.paged.kernels.flash_attn:paged_attention_flash_attn")]
    dispatcher = build_dispatcher(spec, decls, ["flash_attn_paged"])
    case = paged_case(*DECODE, block_size=16, head_dim=64, dtype=torch.float16)
    with pytest.raises(KernelUnavailable, match="flash_attn_paged failed in decode"):
        dispatcher.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
