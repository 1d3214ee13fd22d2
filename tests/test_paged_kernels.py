"""Every paged kernel against float64 dense attention over random (shuffled) block tables.

The Triton kernel runs under TRITON_INTERPRET=1 (set in conftest.py) at ~5 ms per program x loop step,
so shapes stay tiny; FlexAttention runs eagerly on CPU.
"""
import statistics
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from fakes.batches import paged_case

from kvlab.common.attention.triton_tiles import tiling
from kvlab.paged.kernels import torch_ref
from kvlab.paged.kernels.flex import inverse_block_tables, paged_attention_flex
from kvlab.paged.kernels.torch_ref import paged_attention_torch
from kvlab.paged.kernels.triton_paged import paged_attention_triton

KERNELS = {"torch": paged_attention_torch, "triton": paged_attention_triton, "flex": paged_attention_flex}
TRITON = pytest.param("triton", marks=pytest.mark.triton_cpu)       # CPU tensors: the interpreter only
KERNEL_PARAMS = [TRITON if k == "triton" else k for k in KERNELS]

# (query_lens, context_lens, block_size)
CASES = {
    "decode_mixed_lengths": ([1, 1, 1], [5, 8, 13], 4),
    "decode_length_1": ([1], [1], 4),
    "decode_full_last_block": ([1, 1], [8, 16], 4),
    "block_size_1": ([1, 3], [5, 6], 1),
    "prefill_no_context": ([6], [6], 4),
    "prefill_with_context": ([3, 5], [7, 12], 4),
    "prefill_full_blocks": ([8], [16], 8),
    "mixed_batch": ([1, 4, 1, 2], [9, 4, 1, 8], 4),
}
HEADS = {"gqa2_d16": (4, 2, 16), "gqa3_d24": (6, 2, 24), "mha_d8": (2, 2, 8)}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def quiet_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def run_case(kernel: str, case):
    out = KERNELS[kernel](case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return (out.double() - case.expected).abs().max().item()


@pytest.mark.parametrize("heads", HEADS, ids=list(HEADS))
@pytest.mark.parametrize("case_name", CASES, ids=list(CASES))
@pytest.mark.parametrize("kernel", ["torch", TRITON])
def test_kernel_matches_dense_fp32(kernel, case_name, heads):
    query_lens, context_lens, block_size = CASES[case_name]
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    case = paged_case(query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim)
    assert run_case(kernel, case) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("case_name", ["decode_mixed_lengths", "block_size_1", "prefill_with_context",
                                       "mixed_batch"])
def test_flex_matches_dense_fp32(case_name):
    query_lens, context_lens, block_size = CASES[case_name]
    case = paged_case(query_lens, context_lens, block_size, 6, 2, 24)
    assert run_case("flex", case) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case_name", ["decode_mixed_lengths", "mixed_batch"])
@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_kernel_matches_dense_half(kernel, case_name, dtype):
    query_lens, context_lens, block_size = CASES[case_name]
    case = paged_case(query_lens, context_lens, block_size, 4, 2, 16, dtype=dtype, seed=1)
    error = run_case(kernel, case)
    assert error < TOLERANCE[dtype]


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_empty_batch(kernel):
    case = paged_case([], [], 4)
    out = KERNELS[kernel](case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == (0, 4, 16)


@pytest.mark.triton_cpu
def test_shared_blocks_across_sequences():
    """Two sequences whose tables share their first block (a fork or a prefix hit) read the same K/V."""
    case = paged_case([1, 2], [6, 7], 4, seed=3)
    case.meta.block_tables[1, 0] = case.meta.block_tables[0, 0]
    from fakes.reference import paged_reference
    expected = paged_reference(case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.query_lens,
                               case.meta.context_lens, case.scale)
    for fn in KERNELS.values():
        out = fn(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        assert (out.double() - expected).abs().max().item() < 1e-5


def test_torch_kernel_reuses_its_gather_buffer():
    case = paged_case([1, 1, 1], [5, 8, 13], 4)
    workspace: dict = {}
    case.meta.workspace = workspace     # what the dispatcher does: one workspace per cache, across steps
    paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    scratch = workspace["torch_paged.gather"]
    buffers = {key: t.data_ptr() for key, t in scratch._flat.items()}
    for _ in range(3):
        paged_attention_torch(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert workspace["torch_paged.gather"] is scratch
    assert {key: t.data_ptr() for key, t in scratch._flat.items()} == buffers


def test_gather_buffer_grows_and_keeps_capacity():
    buffer = torch_ref.GatherBuffer()
    small = buffer.take(10, torch.float32, torch.device("cpu"))
    big = buffer.take(100, torch.float32, torch.device("cpu"))
    again = buffer.take(50, torch.float32, torch.device("cpu"))
    assert small.numel() == 10 and big.numel() == 100 and again.data_ptr() == big.data_ptr()


@pytest.mark.parametrize("group, decode, expected", [(1, True, (1, 16)), (3, True, (1, 16)), (32, True, (1, 32)),
                                                     (1, False, (64, 1)), (3, False, (16, 4)),
                                                     (64, False, (1, 64))])
def test_triton_tiles_keep_every_dot_dimension_at_least_16(group, decode, expected):
    block_q, group_pad = tiling(group, decode)
    assert (block_q, group_pad) == expected
    assert block_q * group_pad >= 16 and group_pad >= group


def test_inverse_block_tables_maps_physical_to_logical():
    tables = torch.tensor([[5, 2, 0], [2, 7, 1]], dtype=torch.int32)
    inverse = inverse_block_tables(tables, torch.tensor([8, 9]), block_size=4, num_blocks=8)
    assert inverse[0].tolist() == [-1, -1, 1, -1, -1, 0, -1, -1]    # 8 tokens = 2 blocks: the 0 is padding
    assert inverse[1].tolist() == [-1, 2, 0, -1, -1, -1, -1, 1]


# -- measurement: the torch gather kernel against dense SDPA on a contiguous cache (docs/gpu-contracts.md §5) ---
def _median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@pytest.mark.slow
@pytest.mark.parametrize("context", [512, 2048])
def test_measure_gather_decode_vs_dense_sdpa(context, capsys):
    torch.set_num_threads(1)
    batch, heads, head_dim, block_size = 16, 8, 64, 16
    case = paged_case([1] * batch, [context] * batch, block_size, heads, heads, head_dim, spare_blocks=0)
    # the same keys and values, laid out densely ([B, H, context, D]) as a contiguous cache holds them
    k_dense, v_dense = (c[case.meta.block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
                        for c in (case.k_cache, case.v_cache))
    q = case.q

    def run_paged() -> torch.Tensor:
        return paged_attention_torch(q, case.k_cache, case.v_cache, case.meta, case.scale)

    def run_dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), k_dense, v_dense, scale=case.scale).squeeze(2)

    for out in (run_paged(), run_dense()):   # the two timed calls compute the same attention
        torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5)
    paged, dense = _median_ms(run_paged), _median_ms(run_dense)
    with capsys.disabled():
        print(f"\n[decode B={batch} H=H_kv={heads} D={head_dim} block={block_size} ctx={context} fp32 1 thread] "
              f"paged gather+SDPA {paged:.2f} ms, dense SDPA {dense:.2f} ms, ratio {paged / dense:.2f}")
