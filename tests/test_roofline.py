import pytest

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.errors import ConfigError
from kvlab.common.request import SchedulerOutput
from kvlab.common.sequence import Sequence
from kvlab.experiments.sim.roofline import RooflineCost, RooflineRunner, hardware, model_spec


def test_llama3_8b_preset_matches_the_article():
    m = model_spec("llama3-8b")
    assert m.weight_bytes == pytest.approx(16.06e9, rel=1e-3)
    assert m.kv_bytes_per_token == 131_072 == m.kv_shape().bytes_per_token


def test_hardware_presets():
    assert hardware("h100").bandwidth == 3.35e12
    assert hardware("h200").bandwidth == 4.8e12
    assert hardware("a100-80g").bandwidth == pytest.approx(2.039e12)
    with pytest.raises(ConfigError, match="unknown hardware"):
        hardware("tpu")


def test_decode_step_is_weights_plus_kv_over_bandwidth():
    cost = RooflineCost(hardware("h100"), model_spec("llama3-8b"))
    w = model_spec("llama3-8b").weight_bytes
    assert cost.decode_seconds(0) == pytest.approx(w / 3.35e12)
    # 149 sequences of ~1,241 tokens: the KV term exceeds the weights (the article's point)
    kv = 149 * 1241 * 131_072
    assert cost.decode_seconds(149 * 1241) == pytest.approx((w + kv) / 3.35e12)
    assert kv > w


def test_prefill_is_off_by_default_and_matches_the_article_recompute_estimate():
    m = model_spec("llama3-8b")
    off = RooflineCost(hardware("h100"), m)
    on = RooflineCost(hardware("h100"), m, model_prefill=True, mfu=0.5)
    assert off.step_seconds(100, 5000) == off.decode_seconds(100)
    assert on.step_seconds(100, 5000) == pytest.approx(off.decode_seconds(100) + on.prefill_seconds(5000))
    # the article: 196,631 tokens to recompute ~ 6.4 s of H100 prefill at 50% MFU
    assert on.prefill_seconds(196_631) == pytest.approx(6.4, abs=0.05)
    with pytest.raises(ConfigError, match="mfu"):
        RooflineCost(hardware("h100"), m, mfu=0)


def test_model_spec_from_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}')
    m = model_spec(str(tmp_path), dtype="float16")
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert m.weight_bytes == 2 * m.config.num_params
    with pytest.raises(ConfigError, match="unknown model"):
        model_spec(str(tmp_path / "nope"))


def test_runner_advances_the_clock_and_samples_only_logit_items():
    cost = RooflineCost(hardware("h100"), model_spec("llama3-8b"))
    runner = RooflineRunner(cost, token_id=7)
    a, b = Sequence(0, "a", [1] * 10, 5), Sequence(1, "b", [1] * 20, 5)

    out = SchedulerOutput(items=[BatchItem(a, 0, 10), BatchItem(b, 0, 8, needs_logits=False)])
    assert runner.execute(out) == {0: 7}
    assert runner.clock() == pytest.approx(cost.decode_seconds(18))
    assert runner.prefill_tokens == 18

    before = runner.clock()
    assert runner.execute(SchedulerOutput()) == {} and runner.clock() == before
