"""simulate serve: per-request memory attribution on the simulated clock, the client's --max-concurrency and the
SLO search over it, and tensor parallelism."""
import math

import pytest

from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.core import HOST_TIMED, SimCase, SimSettings, run_case
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.run import ServeSpec, run_point
from kvlab.experiments.workloads.requests import WorkloadSpec

TIMINGS = set(HOST_TIMED)
VMM_2M = SimCase("vmm", 6.0, page_size=2 * 2**20, watermark=0.05)
TIGHT = [SimCase("paged", 1.0, 16), SimCase("vmm", 1.0, page_size=2 * 2**20)]     # preempts at rate inf


def per_request(r: dict, key: str) -> list:
    return [q[key] for q in r["requests"]]


@pytest.mark.parametrize("case", TIGHT, ids=lambda c: c.label)
def test_attribution_totals_are_the_sums_and_preemptions_match_the_run(case):
    r = run_point(case, ServeSpec(num_requests=200), math.inf, 0)
    assert r["server_preemptions"] > 0 and len(r["requests"]) == 200
    for key in ("kv_wait_s", "num_preemptions", "recomputed_tokens", "map_unmap_s"):
        assert r[f"total_{key}"] == pytest.approx(sum(per_request(r, key)), rel=1e-12, abs=1e-12)
    assert r["total_num_preemptions"] == r["server_preemptions"] == r["sim"]["preemptions"]
    assert r["total_recomputed_tokens"] == r["sim"]["recomputed_tokens"]
    assert r["total_kv_wait_s"] > 0 and min(per_request(r, "kv_wait_s")) >= 0
    assert r["total_map_unmap_s"] == 0.0          # zero driver costs: no simulated map/unmap time (not host time)


@pytest.mark.parametrize("overlap", [False, True])
def test_apportioned_map_unmap_sums_to_the_ledgers_charge(overlap):
    spec = ServeSpec(num_requests=120, driver_profile="cuda-a100", background_mapping=overlap)
    r = run_point(VMM_2M, spec, 8.0, 0)
    d = r["driver"]
    assert d["driver_seconds"] > 0 and d["driver_unattributed_seconds"] == 0.0
    assert d["driver_seconds"] == pytest.approx(d["driver_exposed_seconds"] + d["driver_hidden_seconds"])
    assert r["total_map_unmap_s"] == pytest.approx(d["driver_seconds"], rel=1e-9)
    assert r["total_map_unmap_exposed_s"] == pytest.approx(d["driver_exposed_seconds"], rel=1e-9, abs=1e-15)
    assert sum(q["map_unmap_s"] > 0 for q in r["requests"]) > 1       # shared out, not pinned on one request
    if overlap:
        assert r["total_map_unmap_exposed_s"] < r["total_map_unmap_s"]


def test_paged_driver_costs_are_not_map_unmap():
    r = run_point(SimCase("paged", 6.0, 16, watermark=0.05), ServeSpec(num_requests=60, driver_profile="cuda-a100"),
                  8.0, 0)
    assert r["driver"]["paged_overhead_seconds"] > 0 and r["total_map_unmap_s"] == 0.0


def test_max_concurrency_caps_requests_in_flight_and_times_from_the_send():
    case = SimCase("paged", 6.0, 16, watermark=0.05)
    spec = ServeSpec(num_requests=40)
    free = run_point(case, spec, math.inf, 0)
    one = run_point(case, spec, math.inf, 0, max_concurrency=1)
    four = run_point(case, spec, math.inf, 0, max_concurrency=4)
    assert free["max_concurrent_requests"] == 40 and one["max_concurrent_requests"] == 1
    assert four["max_concurrent_requests"] == 4 and one["max_concurrency"] == 1 and free["max_concurrency"] is None
    # one at a time: each request is sent when the previous one ends, so none overlaps and none waits in the server
    starts = sorted((q["start_s"], q["start_s"] + q["e2el_s"]) for q in one["requests"])
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(starts, starts[1:]))
    assert one["total_kv_wait_s"] == pytest.approx(0.0, abs=1e-9) and one["total_client_wait_s"] > 0
    # vllm bench serve starts a request's clock when it is sent (after the client's semaphore), not at arrival
    assert one["p99_ttft_ms"] < four["p99_ttft_ms"] < free["p99_ttft_ms"]
    assert one["duration"] > four["duration"] > free["duration"]
    same = run_point(case, spec, math.inf, 0, max_concurrency=40)
    assert {k: v for k, v in same["sim"].items() if k not in TIMINGS} == \
        {k: v for k, v in free["sim"].items() if k not in TIMINGS}


@pytest.mark.parametrize("knee", [0, 1, 7, 64, 300, 2000])
def test_concurrency_search_finds_a_planted_integer_knee(knee):
    calls = []

    def service(n):             # flat up to the knee, blows up past it
        calls.append(n)
        return {"failed": 0, "p99_ttft_ms": 100.0 if n <= knee else 1e5, "p99_tpot_ms": 20.0}
    found = slo.search_int(service, slo.parse_slo("p99_ttft_ms<=2000"), start=4, high_limit=2000)
    assert found.rate == knee
    assert len(calls) <= 2 * math.log2(2000) + 2
    assert all(ok == (n <= knee) for n, ok in found.evaluations)


def test_cli_concurrency_search(tmp_path, capsys):
    argv = ["simulate", "serve", "--backends", "reserve,paged-16", "--num-prompts", "30", "--budget-gb", "6",
            "--jobs", "1", "--no-progress", "--seeds", "2", "--search", "max-concurrency",
            "--slo", "p99_ttft_ms<=300", "--slo-start", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "SLO max concurrency" in out and "ratio" in out
    assert (tmp_path / "sim_slo_rate.png").is_file()
    import json
    data = json.loads((tmp_path / "sim_serve.json").read_text())["result"]
    assert data["axis"] == "max-concurrency"
    for search in data["searches"]:
        n = search["slo_max_concurrency"]
        assert 1 <= n < 30 and [n, True] in search["evaluations"] and [n + 1, False] in search["evaluations"]


def test_tensor_parallel_serve_matches_the_offline_simulator():
    case = SimCase("paged", 6.0, 16, watermark=0.05)
    offline = run_case(case, SimSettings(WorkloadSpec(num_requests=150), model="llama3-70b",
                                         tensor_parallel_size=2)).to_json()
    served = run_point(case, ServeSpec(num_requests=150, model="llama3-70b", tensor_parallel_size=2), math.inf, 0)
    one = run_point(case, ServeSpec(num_requests=150, model="llama3-70b"), math.inf, 0)
    strip = lambda d: {k: v for k, v in d.items() if k not in TIMINGS}      # noqa: E731
    assert strip(served["sim"]) == strip(offline)
    assert served["sim"]["tensor_parallel_size"] == 2 and served["sim"]["allreduce_seconds"] > 0
    # per-GPU budget of one rank's KV: twice the tokens fit, so the batch grows; the step cost changes
    assert served["sim"]["max_batch"] > one["sim"]["max_batch"]
    assert served["duration"] != one["duration"]


def test_cli_tensor_parallel_flag(capsys):
    assert main(["simulate", "serve", "--backends", "paged-16", "--num-prompts", "20", "--budget-gb", "6",
                 "--model", "llama3-70b", "--tensor-parallel-size", "2", "--jobs", "1", "--no-progress",
                 "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "2 x h100 (tensor parallel" in out
    assert "warning: 20 requests is a short run" in out and "request rates and goodput" in out   # < 1000
    assert main(["simulate", "serve", "--tensor-parallel-size", "0", "--no-save"]) == 2
