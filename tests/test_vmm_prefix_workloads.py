"""Prefix-structured workloads (experiments/workloads/prefix.py): the Mooncake-schema loader and synthesiser,
the generators, and the simulator running them with prefix caching on both backends."""
from __future__ import annotations

import json

import pytest

from kvlab.common.errors import ConfigError
from kvlab.experiments.sim.core import SimCase, SimSettings, simulate
from kvlab.experiments.workloads import prefix as pw
from kvlab.experiments.workloads.requests import WorkloadSpec


def test_equal_hash_ids_give_equal_blocks_and_different_ids_different_ones():
    a, b = pw.block_tokens(7, 16, 1000, seed=1), pw.block_tokens(7, 16, 1000, seed=1)
    assert a == b and len(a) == 16 and all(3 <= t < 1000 for t in a)
    assert pw.block_tokens(8, 16, 1000, seed=1) != a and pw.block_tokens(7, 16, 1000, seed=2) != a
    full = pw.synthesize([7, 8], 40, 16, 1000, seed=1, salt=0)
    assert full[:16] == a and len(full) == 40
    assert pw.synthesize([7, 8], 40, 16, 1000, seed=1, salt=1)[:32] == full[:32]   # only the uncovered tail differs


def test_the_sample_trace_loads_with_its_block_size_and_shares_what_its_ids_share():
    reqs = pw.load_mooncake(pw.SAMPLE_TRACE, block_size=16, vocab_size=1000)
    rows = [json.loads(line) for line in pw.SAMPLE_TRACE.read_text().splitlines()]
    assert len(reqs) == len(rows) == 24 and reqs[0].arrival_s == 0
    assert [len(r.token_ids) for r in reqs] == [row["input_length"] for row in rows]
    for r, row in zip(reqs, rows):
        for other, orow in zip(reqs, rows):
            common = 0
            while common < min(len(row["hash_ids"]), len(orow["hash_ids"])) and \
                    row["hash_ids"][common] == orow["hash_ids"][common]:
                common += 1
            n = min(common * 16, len(r.token_ids), len(other.token_ids))
            assert r.token_ids[:n] == other.token_ids[:n]
    assert pw.shareable_tokens(reqs) > 0


def test_a_bad_trace_line_is_a_config_error(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}\n')
    with pytest.raises(ConfigError, match="input_length"):
        pw.load_mooncake(bad, block_size=16)
    with pytest.raises(ConfigError, match="does not exist"):
        pw.load_mooncake(tmp_path / "missing.jsonl")


def test_generators_have_the_prefix_structure_they_promise():
    sys_reqs = pw.system_prompts(40, k=3, system_len=50, tail_len=5, vocab_size=500, seed=3)
    groups = {r.group for r in sys_reqs}
    assert groups <= {"system0", "system1", "system2"}
    by_group = [r for r in sys_reqs if r.group == "system0"]
    assert len(by_group) > len(sys_reqs) / 3     # Zipf: the first prompt is the most popular
    assert all(r.token_ids[:50] == by_group[0].token_ids[:50] for r in by_group)
    turns = pw.multi_turn(2, turns=3, system_len=8, user_len=4, answer_len=4, vocab_size=500)
    conv = [r for r in turns if r.group == "conv0"]
    assert [len(r.token_ids) for r in conv] == [12, 20, 28]
    assert conv[2].token_ids[:20] == conv[1].token_ids and conv[1].token_ids[:12] == conv[0].token_ids
    shots = pw.few_shot(5, preamble_len=30, tail_len=6, vocab_size=500)
    assert len({tuple(r.token_ids[:30]) for r in shots}) == 1 and len({tuple(r.token_ids) for r in shots}) == 5
    assert pw.shareable_tokens(shots) == 4 * 30


@pytest.mark.parametrize("policy,unit", [("paged", {"block_size": 16}), ("vmm", {"page_size": 2 ** 20})])
def test_the_simulator_sends_real_tokens_and_hits_with_prefix_caching(policy, unit):
    reqs = pw.as_sim_requests(pw.few_shot(12, preamble_len=1024, tail_len=64, output_len=8, vocab_size=32000,
                                                interval_s=0.05))
    settings = SimSettings(WorkloadSpec(num_requests=12), model_prefill=True, engine={"enable_prefix_caching": True})
    off = SimSettings(WorkloadSpec(num_requests=12), model_prefill=True)   # prefill costs time: TTFT shows hits
    case = SimCase(policy, 4.0, **unit)
    on, off = simulate(case, settings, reqs), simulate(case, off, reqs)
    assert on.metrics.output_tokens == off.metrics.output_tokens == 12 * 8
    assert off.cache_stats.prefix_hit_tokens == 0
    tokens_per_unit = on.cache_stats.tokens_per_unit
    assert on.cache_stats.prefix_hit_tokens == 11 * (1024 // tokens_per_unit * tokens_per_unit)
    assert on.metrics.computed_tokens == off.metrics.computed_tokens - on.cache_stats.prefix_hit_tokens
    assert on.metrics.ttft_p50 < off.metrics.ttft_p50


def test_kvlab_prefix_writes_json_csv_report_and_plot(tmp_path):
    from kvlab.experiments.cli import main as cli
    assert cli.main(["prefix", "--runs", "sim", "--workloads", "trace", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {r["backend"] for r in rows} == {"paged", "vmm"} and len(rows) == 3
    by_unit = {r["tokens_per_unit"]: r for r in rows}
    assert by_unit[16]["hit_tokens"] > 0 and by_unit[16]["granularity_loss"] == 0   # the trace's blocks are 16
    assert by_unit[1024]["hit_tokens"] <= by_unit[16]["hit_tokens"]
    for r in rows:
        assert r["shareable_tokens"] == r["granularity_loss"] + r["missed_tokens"] + r["hit_tokens"]
    assert (tmp_path / "rows.csv").read_text().startswith("run,workload,backend")
    assert "ttft_p50_on_ms" in (tmp_path / "rows.csv").read_text().splitlines()[0]
    from helpers.provenance_check import read_back
    assert read_back(tmp_path, "rows.json", "prefix")["workloads"] == ["trace"]
    assert (tmp_path / "prefix.png").stat().st_size > 0 and (tmp_path / "report.txt").is_file()


def test_the_serving_bench_datasets_carry_the_prefix_structure():
    from kvlab.experiments.loadgen import datasets
    reqs = datasets.build(f"mooncake:{pw.SAMPLE_TRACE}:16", 24, 0, 1000)
    assert len(reqs) == 24 and reqs[0].timestamp == 0 and reqs[0].prompt[:64] == reqs[1].prompt[:64]
    shots = datasets.build("prefix:fewshot", 5, 0, 1000)
    assert len(shots) == 5 and shots[0].prompt[:384] == shots[4].prompt[:384]
    assert len(datasets.build("prefix:multiturn", 8, 0, 1000)) == 8
    with pytest.raises(ConfigError, match="prefix:system"):
        datasets.build("prefix:nope", 5, 0, 1000)
