import json
import math

import numpy as np
import pytest

from kvlab.common.errors import ConfigError
from kvlab.experiments.workloads.requests import (
    SEED_OUTPUTS,
    SEED_PROMPTS,
    Z95,
    LogNormal,
    Request,
    WorkloadSpec,
    build_workload,
    load_trace,
    parse_workload,
    poisson_arrivals,
    prompt_token_ids,
    save_trace,
    summarize,
)


def test_lognormal_parameters_reproduce_the_article_statistics():
    assert SEED_PROMPTS.median == pytest.approx(584)
    assert SEED_PROMPTS.quantile(Z95) == pytest.approx(2155)
    assert SEED_OUTPUTS.mean == pytest.approx(374)
    assert SEED_OUTPUTS.quantile(Z95) == pytest.approx(1118)
    assert SEED_OUTPUTS.sigma < Z95  # the smaller root: median below mean by a plausible factor


def test_lognormal_from_impossible_statistics_is_an_error():
    with pytest.raises(ConfigError, match="no log-normal"):
        LogNormal.from_mean_p95(100, 90)
    with pytest.raises(ConfigError, match="median < p95"):
        LogNormal.from_median_p95(500, 400)


def test_large_seeded_sample_matches_the_article_within_tolerance():
    unclipped = summarize(build_workload(WorkloadSpec(num_requests=200_000, seed=1, max_len=10**9)))
    assert unclipped["prompt_median"] == pytest.approx(584, rel=0.01)
    assert unclipped["prompt_p95"] == pytest.approx(2155, rel=0.02)
    assert unclipped["output_mean"] == pytest.approx(374, rel=0.02)
    assert unclipped["output_p95"] == pytest.approx(1118, rel=0.02)
    reqs = build_workload(WorkloadSpec(num_requests=200_000, seed=1))
    s = summarize(reqs)
    assert max(r.total_len for r in reqs) == 4096
    # the 4,096 cap trims prompts of the rare long pairs: the article's statistics survive it
    assert s["prompt_median"] == pytest.approx(584, rel=0.01)
    assert s["prompt_p95"] == pytest.approx(2155, rel=0.02)
    assert s["output_mean"] == pytest.approx(374, rel=0.02)
    assert s["output_p95"] == unclipped["output_p95"]
    assert s["output_mean"] < unclipped["output_mean"] and s["prompt_p95"] <= unclipped["prompt_p95"]
    assert min(min(r.prompt_len, r.output_len) for r in reqs) >= 1


def test_same_seed_same_workload_and_scale_shrinks_lengths():
    a = build_workload(WorkloadSpec(num_requests=500, seed=3))
    b = build_workload(WorkloadSpec(num_requests=500, seed=3))
    c = build_workload(WorkloadSpec(num_requests=500, seed=4))
    small = build_workload(WorkloadSpec(num_requests=500, seed=3, scale=1 / 16))
    assert a == b and a != c
    assert max(r.total_len for r in small) <= 256
    assert np.median([r.prompt_len for r in small]) == pytest.approx(584 / 16, rel=0.15)


def test_fixed_and_uniform_lengths():
    fixed = build_workload(WorkloadSpec(kind="fixed", num_requests=5, prompt_len=7, output_len=3))
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(7, 3)}
    uni = build_workload(WorkloadSpec(kind="uniform", num_requests=2000, prompt_len=(10, 20), output_len=(1, 4)))
    assert {r.prompt_len for r in uni} == set(range(10, 21))
    assert {r.output_len for r in uni} == {1, 2, 3, 4}


def test_poisson_arrivals_have_the_requested_rate():
    rng = np.random.default_rng(0)
    t = poisson_arrivals(rng, 20_000, rate=5.0)
    assert np.all(np.diff(t) >= 0)
    assert 20_000 / t[-1] == pytest.approx(5.0, rel=0.03)
    assert not poisson_arrivals(rng, 3, rate=0).any()
    reqs = build_workload(WorkloadSpec(num_requests=10, rate=2.0))
    assert reqs[0].arrival_s > 0 and reqs[-1].arrival_s > reqs[0].arrival_s


def test_trace_round_trip_limit_and_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    reqs = [Request(5, 2, 0.0), Request(9, 4, 1.5)]
    save_trace(path, reqs)
    assert load_trace(path) == reqs
    assert load_trace(path, limit=1) == reqs[:1]
    assert build_workload(WorkloadSpec(kind="trace", trace=str(path), num_requests=10)) == reqs
    path.write_text(json.dumps({"prompt_len": 3}) + "\n")
    with pytest.raises(ConfigError, match=r"t.jsonl:1: need"):
        load_trace(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("text, kind", [("seed", "seed"), ("fixed:16:8", "fixed"),
                                        ("uniform:4-8:1-2", "uniform"), ("trace:x.jsonl", "trace")])
def test_parse_workload(text, kind):
    assert parse_workload(text).kind == kind


@pytest.mark.parametrize("text", ["fixed:16", "uniform:4:2", "poisson", "seed:3", "trace:"])
def test_parse_workload_errors(text):
    with pytest.raises(ConfigError, match="bad workload"):
        parse_workload(text)


def test_prompt_token_ids_are_seeded_and_in_range():
    reqs = [Request(5, 1), Request(3, 1)]
    ids = prompt_token_ids(reqs, vocab_size=50, seed=0)
    assert [len(x) for x in ids] == [5, 3]
    assert all(3 <= t < 50 for x in ids for t in x)
    assert ids == prompt_token_ids(reqs, vocab_size=50, seed=0)
    assert math.isfinite(sum(map(sum, ids)))
