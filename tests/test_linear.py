"""The Linear layers' GEMM (common/linear.py): which one each setting picks, why, and that oneDNN's agrees with
torch's F.linear wherever the model calls it."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kvlab.common import linear
from kvlab.common.config import EngineConfig, validate
from kvlab.common.errors import ConfigError
from kvlab.common.linear import choose_linear, onednn_unusable
from kvlab.common.model import Linear

HAS_ONEDNN = onednn_unusable(torch.float32, torch.device("cpu")) is None
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="this torch build has no usable oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("x", [
    torch.randn(7, 96), torch.randn(2, 5, 96), torch.randn(0, 96),
    torch.randn(96, 6).t(), torch.randn(4, 192)[:, ::2]], ids=["2d", "3d", "no rows", "transposed", "strided"])
def test_onednn_agrees_with_f_linear_on_every_input_the_model_passes(x):
    w = torch.randn(40, 96)
    got = linear.onednn_linear(x, w)
    assert got.shape == (*x.shape[:-1], 40)
    assert torch.allclose(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_auto_and_onednn_pick_onednn_for_float32_on_the_cpu():
    for requested in ("auto", "onednn"):
        impl = choose_linear(requested, torch.float32, "cpu")
        assert impl.name == "onednn" and impl.fn is linear.onednn_linear


def test_torch_is_f_linear_everywhere():
    impl = choose_linear("torch", torch.float32, "cpu")
    assert impl.name == "torch" and impl.fn is F.linear


@pytest.mark.parametrize("dtype, device, why", [
    (torch.bfloat16, "cpu", "bfloat16 weights"), (torch.float32, "cuda", "on cuda")])
def test_auto_keeps_torch_off_float32_cpu_and_says_why(dtype, device, why, caplog):
    with caplog.at_level(logging.WARNING, logger="kvlab.model"):
        impl = choose_linear("auto", dtype, device)
    assert impl.name == "torch" and why in impl.reason
    assert not caplog.records                       # nothing was expected of oneDNN there: no warning
    with pytest.raises(ConfigError, match=f"linear onednn is not usable here: .*{why}"):
        choose_linear("onednn", dtype, device)


def test_auto_falls_back_to_torch_with_a_warning_when_the_probe_fails(monkeypatch, caplog):
    def broken(x, w):
        raise RuntimeError("no primitive for this shape")
    monkeypatch.setattr(linear, "onednn_linear", broken)
    with caplog.at_level(logging.WARNING, logger="kvlab.model"):
        impl = choose_linear("auto", torch.float32, "cpu")
    assert impl.fn is F.linear and "probe" in impl.reason
    assert any("not oneDNN" in r.getMessage() for r in caplog.records)


def test_a_disagreeing_onednn_is_not_used(monkeypatch):
    monkeypatch.setattr(linear, "onednn_linear", lambda x, w: F.linear(x, w) * 1.001)
    assert "disagrees" in choose_linear("auto", torch.float32, "cpu").reason


def test_an_unknown_name_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown linear 'mkl'"):
        choose_linear("mkl", torch.float32, "cpu")
    with pytest.raises(ConfigError, match="linear"):
        validate(EngineConfig(linear="mkl"))


def test_use_linear_sets_every_layer_and_the_lm_head():
    from kvlab.common.presets import load_preset
    model, _ = load_preset("tiny", "float32", "cpu", 0)
    assert model.linear.name == "torch"                 # a bare model runs F.linear until told otherwise
    impl = model.use_linear("auto")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * model.config.num_layers + 1
    assert all(m.gemm is impl.fn for m in layers) and model.linear is impl


@needs_onednn
def test_the_engine_runs_its_config_s_gemm_and_greedy_tokens_match_torch_s():
    from kvlab import LLM, SamplingParams
    prompts = [[(11 * i + 5 * j) % 1000 + 3 for j in range(8 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for requested in ("torch", "onednn"):
        llm = LLM("tiny", backend="paged", linear=requested)
        try:
            assert llm.engine.runner.model.linear.name == requested
            outputs[requested] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert outputs["torch"] == outputs["onednn"]
