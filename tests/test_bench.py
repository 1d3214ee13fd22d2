import csv
import json

import pytest

from kvlab.experiments.bench.runs import median_run
from kvlab.experiments.cli.main import main

RUN_KEYS = ("backend", "output_tokens_per_s", "mean_batch", "kv_utilization", "preemptions", "ttft_p50", "tpot_p50",
            "allocator_seconds", "kernels", "timeline")


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "--model", "tiny", "--backends", "vmm,paged,reserve", "--num-requests", "12",
               "--scale", "0.05", "--repeats", "1", "--warmup", "1", "--out", str(out), "--no-progress"])
    return rc, out


def test_a_short_bench_warns_that_its_rates_are_not_a_steady_states(tmp_path, capsys):
    assert main(["bench", "--model", "tiny", "--backends", "vmm", "--num-requests", "4", "--scale", "0.05",
                 "--repeats", "1", "--warmup", "0", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "warning: 4 requests is a short run" in out and "tok/s and req/s" in out and ">= 256 requests" in out


def test_bench_writes_results_json_csv_and_plots(tiny_bench):
    rc, out = tiny_bench
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert [r["backend"] for r in runs] == ["vmm", "paged", "reserve"]
    for r in runs:
        for key in RUN_KEYS:
            assert key in r, key
        assert r["output_tokens_per_s"] > 0 and r["num_failed"] == 0
        assert 0 < r["kv_utilization"] <= 1
        assert r["outputs_match_first"] <= r["num_requests"] == 12
        assert len(r["timeline"]["time"]) == r["num_steps"]
    assert {r["output_tokens"] for r in runs} == {sum(w["output_len"] for w in data["settings"]["workload"])}
    with open(out / "results.csv") as f:
        assert [row["backend"] for row in csv.DictReader(f)] == ["vmm", "paged", "reserve"]
    for name in ("throughput.png", "batch.png", "kv_memory.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_budget_separates_reservation_from_on_demand(tiny_bench):
    _, out = tiny_bench
    runs = {r["backend"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    # the default budget holds 8 max-length reservations: on-demand backends run a larger batch
    assert runs["reserve"]["max_batch"] <= 8
    assert runs["paged"]["mean_batch"] > runs["reserve"]["mean_batch"]
    assert runs["vmm"]["mean_batch"] > runs["reserve"]["mean_batch"]
    assert runs["reserve"]["kv_utilization"] < runs["paged"]["kv_utilization"]


def test_median_run_reports_the_middle_throughput():
    rows = [{"output_tokens_per_s": v, "output_ids": [[1]]} for v in (30.0, 10.0, 20.0)]
    chosen = median_run(rows)
    assert chosen["output_tokens_per_s"] == 20.0
    assert chosen["repeats_output_tokens_per_s"] == [30.0, 10.0, 20.0]
    assert chosen["outputs_stable_across_repeats"]


def test_bench_rejects_bad_repeats(capsys):
    assert main(["bench", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_bench_defaults_leave_what_the_user_set(tmp_path):
    from kvlab.common.kv.types import KVShape
    from kvlab.experiments.bench.offline import settings_from
    from kvlab.experiments.bench.plan import backend_defaults, bench_defaults
    from kvlab.experiments.cli import main as cli
    path = tmp_path / "e.toml"
    path.write_text("page_size = 65536\n")
    args = settings_from(cli.build_parser().parse_args(["bench", "--config", str(path), "--kv-cache-bytes", "4MiB"]))
    shape = KVShape(4, 2, 64, 4)                         # tiny: 512 B of K per token per layer
    defaults = bench_defaults(args, args.engine_config("vmm"), shape, max_len=512)
    assert "page_size" not in defaults and "kv_cache_bytes" not in defaults
    assert defaults["max_model_len"] == 512 and defaults["threads"] == 1
    plain = settings_from(cli.build_parser().parse_args(["bench"]))
    auto = bench_defaults(plain, plain.engine_config("vmm"), shape, max_len=512)
    assert auto["page_size"] == 16 * 512                # one page holds one 16-token block's worth
    assert auto["kv_cache_bytes"] == 8 * 512 * shape.bytes_per_token
    assert backend_defaults(plain, "reserve") == {"watermark": 0.0}
    assert backend_defaults(plain, "paged") == {}
    tabled = tmp_path / "t.toml"
    tabled.write_text("[vmm]\npage_size = 65536\n")
    in_table = settings_from(cli.build_parser().parse_args(["bench", "--config", str(tabled)]))
    assert "page_size" not in bench_defaults(in_table, in_table.engine_config("vmm"), shape, max_len=512)
    watermarked = settings_from(cli.build_parser().parse_args(["bench", "--watermark", "0.1"]))
    assert backend_defaults(watermarked, "reserve") == {}


def test_bench_budget_error_prints_nothing_before_it(capsys):
    """Every backend's budget is checked before the header: one error line, nothing on stdout (issue 18.7)."""
    assert main(["bench", "--kv-cache-bytes", "10", "--no-progress"]) == 2
    out = capsys.readouterr()
    assert out.out == "", out.out
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvlab bench: error: ") and "holds no page group" in lines[0], lines


def test_bench_records_provenance_per_request_rows_and_units(tiny_bench):
    from helpers.provenance_check import read_back
    _, out = tiny_bench
    config = read_back(out, "results.json", "bench")
    assert config["backends"] == ["vmm", "paged", "reserve"] and config["repeats"] == 1
    assert config["engine"]["vmm"]["vmm"]["page_size"] == config["built"]["vmm"]["page_bytes"]
    assert config["workload"]["num_requests"] == 12 and config["engine"]["paged"]["threads"] == 1
    with open(out / "results.csv") as f:
        row = next(csv.DictReader(f))
    assert "ttft_p50_ms" in row and "ttft_p50" not in row and row["kernel_decode"]
    assert not any(v.startswith(("{'", "['")) for v in row.values())       # no Python reprs
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert isinstance(runs[0]["kernels"], dict) and isinstance(runs[0]["repeats"], dict)
    with open(out / "requests.csv") as f:
        requests = list(csv.DictReader(f))
    assert len(requests) == 3 * 12 and {"ttft_ms", "tpot_ms", "e2e_ms", "arrival_ms"} <= set(requests[0])
    by_backend = {b: sum(int(q["output_tokens"]) for q in requests if q["backend"] == b) for b in config["backends"]}
    assert set(by_backend.values()) == {runs[0]["output_tokens"]}


def test_the_report_counts_the_drivers_os_calls_beside_the_allocator_share():
    from kvlab.experiments.bench.report import os_calls
    vmm = {"cache": {"map_calls": 9624, "unmap_calls": 6704, "map_seconds": 0.1, "unmap_seconds": 0.11}}
    assert os_calls(vmm) == "16,328 (0.21)"
    assert os_calls({"cache": {"map_calls": 0, "unmap_calls": 0}}) == "-"    # paged, reserve: no OS calls


def test_the_report_splits_the_os_calls_by_what_made_them():
    from kvlab.experiments.bench.report import os_calls_by_cause
    vmm = {"cache": {"map_calls": 9624, "unmap_calls": 6704},
           "cache_extra": {"admission_calls": 4536, "growth_calls": 2744, "mapper_calls": 9000}}
    assert os_calls_by_cause(vmm) == "4,536 / 2,744 / 9,000 / 48"          # the rest: frees, swaps, forks
    assert os_calls_by_cause({"cache": {"map_calls": 0, "unmap_calls": 0}, "cache_extra": {}}) == "-"   # paged
