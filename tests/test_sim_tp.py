"""The simulator's tensor-parallel model: per-rank shard costs and KV, ring all-reduces, per-GPU budgets."""
import dataclasses

import pytest

from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.seam import create_cache
from kvlab.experiments.sim.core import SimCase, SimSettings, run_cases
from kvlab.experiments.sim.roofline import RooflineCost, RooflineRunner, hardware, model_spec
from kvlab.experiments.workloads.requests import WorkloadSpec

LINK = dataclasses.replace(hardware("h100"), link_bandwidth=1e9, link_latency=1e-6)   # round hand numbers


def test_ring_allreduce_on_hand_numbers():
    cost = RooflineCost(LINK, model_spec("llama3-70b", tp=2))
    # 10 tokens x 8192 hidden x 2 bytes = 163,840 bytes; 2(2-1)/2 of them over 1 GB/s, plus 2 steps x 1 us
    assert cost.allreduce_seconds(10) == pytest.approx(163_840 / 1e9 + 2e-6, rel=1e-12)
    four = RooflineCost(LINK, model_spec("llama3-70b", tp=4))
    assert four.allreduce_seconds(10) == pytest.approx(6 / 4 * 163_840 / 1e9 + 6e-6, rel=1e-12)
    assert four.comm_seconds(10) == pytest.approx(2 * 80 * four.allreduce_seconds(10), rel=1e-12)
    one = RooflineCost(LINK, model_spec("llama3-70b"))
    assert one.allreduce_seconds(10) == one.comm_seconds(10) == 0.0


def test_h100_link_is_nvlink4_figure():
    cost = RooflineCost(hardware("h100"), model_spec("llama3-70b", tp=4))
    # 6/4 x 100 x 8192 x 2 B / 450 GB/s + 6 x 2 us
    assert cost.allreduce_seconds(100) == pytest.approx(1.5 * 1_638_400 / 450e9 + 12e-6, rel=1e-12)
    assert hardware("a100-80g").link_bandwidth == 300e9 and hardware("h200").link_bandwidth == 450e9


def test_shard_bytes_are_per_rank():
    full, half = model_spec("llama3-8b"), model_spec("llama3-8b", tp=2)
    assert half.kv_bytes_per_token * 2 == full.kv_bytes_per_token == 131_072
    assert half.kv_shape().bytes_per_token == 65_536 and half.kv_shape().num_kv_heads == 4
    c = full.config
    replicated = 2 * c.vocab_size * c.hidden_size + c.hidden_size + c.num_layers * 2 * c.hidden_size
    assert half.num_params == (c.num_params - replicated) // 2 + replicated
    assert half.weight_bytes == 2 * half.num_params and half.flops_per_token == 2.0 * half.num_params
    assert model_spec("llama3-70b", tp=4).weight_bytes == pytest.approx(38.43e9, rel=1e-3)


def test_tp_that_does_not_divide_is_refused_naming_valid_sizes():
    with pytest.raises(ConfigError, match=r"valid sizes: 1, 2, 4, 8$"):
        model_spec("llama3-70b", tp=3)
    with pytest.raises(ConfigError, match="positive integer"):
        model_spec("llama3-70b", tp=0)
    with pytest.raises(ConfigError, match="interconnect"):
        RooflineCost(dataclasses.replace(LINK, link_bandwidth=0.0), model_spec("llama3-8b", tp=2))


@pytest.mark.parametrize("backend, extra", [("paged", {"block_size": 16}), ("reserve", {})])
def test_fixed_per_rank_budget_holds_twice_the_tokens_at_tp2(backend, extra):
    budget = 10 * 4096 * 131_072          # ten 4096-token sequences of Llama-3-8B at tp=1
    config = make_config(backend=backend, kv_cache_bytes=budget, max_model_len=4096, dtype="bfloat16", **extra)
    one = create_cache(config, model_spec("llama3-8b").kv_shape(), accounting_only=True).allocator
    two = create_cache(config, model_spec("llama3-8b", tp=2).kv_shape(), accounting_only=True).allocator
    assert two.num_total_units() == 2 * one.num_total_units()   # paged: 16-token blocks; reserve: tokens
    assert one.num_total_units() == {"paged": 2560, "reserve": 40960}[backend]


def test_step_is_the_shard_roofline_plus_two_allreduces_per_layer():
    from types import SimpleNamespace
    cost = RooflineCost(hardware("h100"), model_spec("llama3-70b", tp=4))
    items = [SimpleNamespace(start=999, num_tokens=1, needs_logits=True, seq=SimpleNamespace(seq_id=i))
             for i in range(8)]
    runner = RooflineRunner(cost)
    runner.execute(SimpleNamespace(items=items))
    roofline = (cost.model.weight_bytes + 8000 * 81_920) / 3.35e12
    assert runner.comm_seconds == cost.comm_seconds(8) == pytest.approx(160 * (1.5 * 8 * 16_384 / 450e9 + 12e-6))
    assert runner.clock() == pytest.approx(roofline + runner.comm_seconds, rel=1e-12)
    plain = RooflineRunner(RooflineCost(hardware("h100"), model_spec("llama3-70b")))
    plain.execute(SimpleNamespace(items=items))
    assert plain.clock() == plain.cost.decode_seconds(8000) and plain.comm_seconds == 0.0   # tp=1: exactly as before


def test_tp2_at_half_the_per_gpu_budget_schedules_like_tp1():
    """The same cluster KV (tp x per-GPU budget) holds the same tokens: the schedule is identical, only the
    clock differs (half the bytes per rank, plus all-reduces)."""
    workload = WorkloadSpec(num_requests=120, seed=0)
    one, = run_cases([SimCase("paged", 3.0, 16)], SimSettings(workload=workload), progress=False)
    two, = run_cases([SimCase("paged", 1.5, 16)], SimSettings(workload=workload, tensor_parallel_size=2),
                     progress=False)
    assert (two.mean_batch, two.num_steps, two.preemptions) == (one.mean_batch, one.num_steps, one.preemptions)
    assert 0 < two.allreduce_seconds < two.sim_seconds < one.sim_seconds
    assert "allreduce_seconds" in two.to_json() and "allreduce_seconds" not in one.to_json()
    assert "tensor_parallel_size" not in one.to_json()       # tp=1 rows keep the seed article's keys


def test_cli_refuses_a_tp_that_does_not_divide(capsys):
    from kvlab.experiments.cli.main import main
    assert main(["simulate", "--model", "llama3-70b", "--tensor-parallel-size", "3", "--no-save"]) == 2
    assert "valid sizes: 1, 2, 4, 8" in capsys.readouterr().err
