"""FP8 KV cache (`kv_cache_dtype`): 1-byte K/V in every backend, quantised on write and dequantised in the kernels.

- capacity: units per byte budget exactly 4x fp32 and 2x bf16, for every registered backend (a hypothesis
  property over budgets and shapes), and CacheStats names the KV dtype;
- greedy outputs of the tiny model (fp32 compute, fp8 KV) are identical across paged, vmm and reserve, and the
  Triton kernel (interpreter) agrees with the torch reference on fp8 caches;
- quantisation: round-trip error within the format's precision, scales from the first write or the config,
  saturation instead of inf;
- the kernel registry refuses fp8 where the library (or kvlab's adapter) cannot read it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.common.attention.dispatch import AttentionSpec, dispatcher_for
from kvlab.common.attention.kv_quant import KVQuant, decode, encode
from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import backend_names, get_backend
from kvlab.common.kv.seam import create_cache
from kvlab.common.kv.types import KVShape
from kvlab.common.llm import LLM
from kvlab.common.sampling_params import SamplingParams
from kvlab.paged.kernels.torch_ref import paged_attention_torch
from kvlab.paged.kernels.triton_paged import paged_attention_triton

FP8 = ("fp8_e4m3", "fp8_e5m2")
PROMPTS = ["the quick brown fox jumps over", "a b c d e f g h i j", "hello"]


def _stats(backend: str, shape: KVShape, kv_dtype: str, budget: int | None = None):
    sizes = get_backend(backend).load_probe().test_options
    if budget is not None:
        sizes = {**sizes, "kv_cache_bytes": budget}
    config = make_config(backend=backend, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                         **sizes, kv_cache_dtype=kv_dtype)
    cache = create_cache(config, shape, accounting_only=True)
    try:
        stats = cache.stats()
        assert stats.extra["kv_cache_dtype"] == kv_dtype
        return stats
    finally:
        cache.close()


def _capacity(backend: str, shape: KVShape, kv_dtype: str, budget: int) -> int:
    """Tokens the whole budget holds, in the backend's own accounting."""
    stats = _stats(backend, shape, kv_dtype, budget)
    return stats.total_units * stats.tokens_per_unit


def _unit_bytes(backend: str, shape: KVShape) -> int:
    """Bytes of one allocation unit at the shape's own dtype (the grain a budget must be a multiple of)."""
    return _stats(backend, shape, "auto").tokens_per_unit * shape.bytes_per_token


@pytest.mark.parametrize("backend", backend_names())
@settings(max_examples=15, deadline=None)
@given(units=st.integers(1, 12), heads=st.sampled_from([(4, 2, 32), (2, 2, 64), (8, 1, 64)]),
       layers=st.integers(1, 3), dtype=st.sampled_from(["float32", "bfloat16"]), kv=st.sampled_from(FP8))
def test_fp8_capacity_is_exactly_4x_fp32_and_2x_bf16(backend, units, heads, layers, dtype, kv):
    q_heads, kv_heads, head_dim = heads
    shape = KVShape(layers, kv_heads, head_dim, q_heads, dtype=dtype)
    fp8_shape = dataclasses.replace(shape, kv_cache_dtype=kv)
    assert fp8_shape.bytes_per_token * (4 if dtype == "float32" else 2) == shape.bytes_per_token
    budget = units * _unit_bytes(backend, shape)
    full = _capacity(backend, shape, "auto", budget)
    assert full > 0
    assert _capacity(backend, shape, kv, budget) == full * (4 if dtype == "float32" else 2)


def _greedy(backend: str, kv: str, **extra) -> tuple[list[list[int]], dict]:
    llm = LLM(model="tiny", backend=backend, kv_cache_dtype=kv, kv_cache_bytes=4 * 2**20, max_model_len=256,
              **extra)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))
        return [o.outputs[0].token_ids for o in outs], llm.engine.cache_stats().extra
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kv", FP8)
def test_fp8_greedy_identical_across_backends(kv):
    paged, stats = _greedy("paged", kv)
    assert stats["kv_cache_dtype"] == kv
    assert _greedy("vmm", kv)[0] == paged
    assert _greedy("reserve", kv)[0] == paged


def test_given_scale_reaches_every_backend():
    paged = _greedy("paged", "fp8_e4m3", kv_cache_scale=0.05)[0]
    assert _greedy("vmm", "fp8_e4m3", kv_cache_scale=0.05)[0] == paged


@pytest.mark.triton_cpu
@pytest.mark.parametrize("kv", FP8)
def test_triton_reads_fp8_like_the_torch_reference(kv):
    from fakes.batches import paged_case
    case = paged_case([1, 3, 1], [6, 9, 13], 4, 4, 2, 16)
    quant = KVQuant(KVShape(1, 2, 16, 4, kv_cache_dtype=kv).fp8_dtype, 1)
    k_raw, v_raw = quant.write(0, case.k_cache, case.v_cache)
    quant.stamp(case.meta, 0)
    ref = paged_attention_torch(case.q, k_raw, v_raw, case.meta, case.scale)
    tri = paged_attention_triton(case.q, k_raw, v_raw, case.meta, case.scale)
    assert (ref - tri).abs().max().item() < 1e-5
    # and against exact attention over the unquantised values: the quantisation error only
    assert (ref.double() - case.expected).abs().max().item() < (0.1 if kv == "fp8_e4m3" else 0.2)


@pytest.mark.parametrize("kv,rel", [("fp8_e4m3", 2 ** -4), ("fp8_e5m2", 2 ** -3)])
def test_round_trip_within_format_precision(kv, rel):
    fp8 = KVShape(1, 1, 8, 1, kv_cache_dtype=kv).fp8_dtype
    x = torch.randn(1000) * 3
    quant = KVQuant(fp8, 1)
    raw, _ = quant.write(0, x, x)
    assert raw.dtype == torch.uint8
    back = decode(raw, fp8, quant.scales[0][0], torch.float32)
    normal = x.abs() > 1e-2 * x.abs().max()
    assert ((back - x).abs()[normal] <= rel * x.abs()[normal]).all()


def test_scales_fixed_by_the_first_write_and_saturate_later():
    quant = KVQuant(torch.float8_e4m3fn, 2)
    quant.write(0, torch.ones(4), torch.full((4,), 2.0))
    k_scale, v_scale = quant.scales[0]
    assert k_scale > 0 and v_scale == pytest.approx(2 * k_scale) and quant.scales[1] == [0.0, 0.0]
    raw, _ = quant.write(0, torch.full((2,), 1e6), torch.ones(2))
    assert quant.scales[0][0] == k_scale                  # not recomputed
    assert torch.isfinite(decode(raw, torch.float8_e4m3fn, k_scale, torch.float32)).all()
    given_scale = KVQuant(torch.float8_e5m2, 1, given=0.5)
    given_scale.write(0, torch.ones(3), torch.ones(3))
    assert given_scale.scales[0] == [0.5, 0.5]
    assert encode(torch.zeros(2), torch.float8_e4m3fn, 1.0).tolist() == [0, 0]


@pytest.mark.parametrize("kv", FP8)
def test_registry_fp8_rules(kv):
    cpu = dispatcher_for(AttentionSpec("paged", "cpu", "float32", 64, 8, 2, block_size=16, kv_cache_dtype=kv))
    assert cpu.chosen("decode") == "torch_paged"
    gpu = AttentionSpec("paged", "cuda", "bfloat16", 128, 32, 8, block_size=256, compute_capability=(9, 0),
                        kv_cache_dtype=kv)
    from kvlab.common.attention.declarations import REGISTRY
    reasons = {d.name: d.reasons_against(gpu) for d in REGISTRY}
    assert any("kv_cache_dtype" in r for r in reasons["flash_attn_paged"])
    assert any("kv_cache_dtype" in r for r in reasons["flashinfer_paged"])
    assert any("kv_cache_dtype" in r for r in reasons["flex_paged"])
    assert not any("kv_cache_dtype" in r for r in reasons["triton_paged"] + reasons["torch_paged"])


def test_config_and_cli_take_kv_cache_dtype():
    assert make_config(kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        make_config(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_cache_scale"):
        make_config(kv_cache_scale=-1.0)
    import argparse

    from kvlab.experiments.cli.flags import add_engine_flags, engine_config
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    args = p.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scale", "0.25"])
    config = engine_config(vars(args))
    assert (config.kv_cache_dtype, config.kv_cache_scale) == ("fp8_e4m3", 0.25)


def test_fallback_study_has_a_kv_dtype_axis():
    from kvlab.experiments.studies.fallbacks.grid import Grid, default_scenarios, row_key, run_grid
    grid = Grid((128,), ("bfloat16",), (16, 256), (4,), ("auto", "fp8_e4m3"))
    rows = run_grid(grid, default_scenarios())
    assert len(rows) == grid.num_rows(len(default_scenarios()))
    index = {row_key(r): r for r in rows}
    auto = index[("cuda+fa+fi", "paged", "decode", 128, "bfloat16", 256, "auto", 4)]
    fp8 = index[("cuda+fa+fi", "paged", "decode", 128, "bfloat16", 256, "fp8_e4m3", 4)]
    assert auto.kernel == "flash_attn_paged" and fp8.kernel == "triton_paged"
    assert fp8.fallback and "kv_dtype" in fp8.causes


def test_roofline_reads_fp8_bytes_and_only_the_window():
    from kvlab.experiments.sim.roofline import model_spec
    bf16, fp8 = model_spec("llama3-8b"), model_spec("llama3-8b", kv_cache_dtype="fp8_e4m3")
    assert 2 * fp8.kv_bytes_per_token == bf16.kv_bytes_per_token
    assert fp8.kv_shape().kv_cache_dtype == "fp8_e4m3"
    assert model_spec("mistral-7b").kv_shape().sliding_window == 4096
    assert model_spec("mistral-7b-full").config.sliding_window is None
