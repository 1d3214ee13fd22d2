"""GPU-only checks (`pytest -m gpu`; experiments/gpu_check.sh runs them): the CUDA VMM driver on real device
memory, the vmm cache's attention over mapped pages, the compiled Triton paged kernel against SDPA, and the
two backends generating on cuda. Skipped, with the reason, where torch.cuda is unavailable.

tests/conftest.py sets TRITON_INTERPRET=1 unless it is already set, and the interpreter is not what a GPU run
should test (and triton 3.6 + numpy >= 2.4 break it): run these with TRITON_INTERPRET=0, as gpu_check.sh does.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from kvlab.common.config import make_config
from kvlab.common.kv.types import KVShape

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda is "
                                                                       "not available)")]
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_compiled_triton = pytest.mark.skipif(INTERPRETING and torch.cuda.is_available(),
                                           reason="TRITON_INTERPRET=1 would test the interpreter; "
                                                  "run with TRITON_INTERPRET=0")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
MiB = 2**20


@pytest.fixture
def cuda_vm():
    pytest.importorskip("cuda.bindings.driver")
    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    vm = CudaVirtualMemory(0)
    yield vm
    gc.collect()
    torch.cuda.synchronize()
    vm.close()


def test_cuda_vmm_maps_real_memory_zero_copy(cuda_vm):
    vm, page = cuda_vm, cuda_vm.page_size
    assert page % vm.granularity() == 0
    region = vm.reserve(3 * page)
    vm.create_store(2)
    vm.map(region, 0, 1, 1)                       # pool page 1 at VA page 0, pool page 0 at VA page 1
    vm.map(region, page, 0, 1)
    view = vm.tensor_view(region, torch.float32, (2 * page // 4,))
    assert view.is_cuda and view.data_ptr() == region.base
    pattern = torch.arange(view.numel(), device="cuda", dtype=torch.float32)
    view.copy_(pattern)
    assert torch.equal(view.cpu(), pattern.cpu())
    del view
    torch.cuda.synchronize()
    vm.unmap(region, 0, 1)                        # pool page 1 keeps its content ...
    vm.map(region, 2 * page, 1, 1)                # ... and shows it at its new address
    moved = vm.tensor_view(region, torch.float32, (page // 4,), offset=2 * page)
    assert torch.equal(moved, pattern[:page // 4])
    del moved
    torch.cuda.synchronize()
    vm.release(region)
    assert vm.stats.num_mappings == 0 and vm.stats.mapped_pages == 0


def test_mapping_consumes_device_memory_reported_by_mem_get_info(cuda_vm):
    vm, pages = cuda_vm, 16
    free_before = torch.cuda.mem_get_info()[0]
    vm.create_store(pages)                          # cuMemCreate allocates physical memory up front
    taken = free_before - torch.cuda.mem_get_info()[0]
    assert taken >= pages * vm.page_size * 0.99
    vm.resize_store(0)                              # cuMemRelease gives it back
    assert torch.cuda.mem_get_info()[0] >= free_before - vm.page_size


def vmm_cache(num_seqs: int, dtype: str):
    from kvlab.vmm.build import build_vmm
    shape = KVShape(num_layers=1, num_kv_heads=2, head_dim=64, num_q_heads=4, dtype=dtype, device="cuda")
    config = make_config(backend="vmm", device="cuda", dtype=dtype, page_size=2 * MiB, max_num_seqs=num_seqs,
                          max_model_len=1024, kv_cache_bytes=2 * num_seqs * 2 * 2 * MiB,
                          max_num_batched_tokens=4096)
    return build_vmm(config, shape)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_vmm_cache_prefill_then_decode_on_cuda(dtype):
    from kvlab.experiments.gpu.cache_steps import prefill_then_decode
    cache = vmm_cache(3, dtype)
    tolerance = TOLERANCE[getattr(torch, dtype)]
    try:
        for step in prefill_then_decode(cache, (100, 37, 300)):
            for got, expected in step:
                torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
        cache.check_invariants()
        assert cache.kernel_report()["runtime_fallbacks"] == []
    finally:
        cache.close()


@needs_compiled_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("query_lens, context_lens", [([1] * 8, [17, 64, 65, 300, 1, 1024, 511, 2048]),
                                                       ([1, 40, 1, 129], [33, 40, 900, 700])])
def test_triton_paged_compiled_matches_sdpa(dtype, query_lens, context_lens):
    from kvlab.experiments.bench.perf.kernel_inputs import paged_case, reference
    from kvlab.paged.kernels.triton_paged import paged_attention_triton
    # Llama-3-8B heads, as gpu_check.sh's Triton part: the kernels it compiled are reused from Triton's cache
    case = paged_case(query_lens, context_lens, 16, 32, 8, 128, dtype, "cuda", seed=1)
    out = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out.float(), reference(case), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_vmm_and_paged_generate_alike_on_cuda():
    from kvlab import LLM, SamplingParams
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (100, 257, 31, 500)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    outputs, reports = {}, {}
    for backend in ("vmm", "paged"):
        with LLM("tiny", backend=backend, device="cuda", dtype="float32", page_size=2 * MiB, max_num_seqs=4,
                 max_model_len=1024, kv_cache_bytes=256 * MiB) as llm:
            outputs[backend] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
            reports[backend] = llm.engine.cache.kernel_report()
    assert all(len(o) == 16 for o in outputs["vmm"] + outputs["paged"])
    # fp32 on both sides; a near-tie between two logits may still flip one greedy token
    assert sum(a == b for a, b in zip(outputs["vmm"], outputs["paged"])) >= 3
    if not INTERPRETING:
        assert reports["paged"]["kernels"]["decode"] == "triton_paged"
        assert reports["paged"]["runtime_fallbacks"] == [] and reports["vmm"]["runtime_fallbacks"] == []
