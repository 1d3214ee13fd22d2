"""`kvlab study pool`: its settings and one-line errors, the configurations' server flags, the alternated order,
the paired table; end to end on real tiny servers under -m slow."""
from __future__ import annotations

import json
import os

import pytest

from kvlab.experiments.cli import main as cli
from kvlab.experiments.cli.main import build_parser
from kvlab.experiments.studies.pool import table
from kvlab.experiments.studies.pool.cli import settings_from
from kvlab.experiments.studies.pool.settings import CONFIGURATIONS


def settings(*argv: str):
    return settings_from(build_parser().parse_args(["study", "pool", *argv]))


def test_defaults_give_every_configuration_the_same_memory():
    s = settings()
    assert s.engines == 3 and s.total_bytes == 9 * 2**20 and [c.key for c in s.configurations] == list("abcde")
    assert s.multi.phases.models == 3 and s.multi.load.goodput == ("ttft:1000", "tpot:100")
    assert s.server_args[:2] == ("--max-model-len", "256")
    for key, backend in (("a", "vmm"), ("e", "elastic")):
        pooled = CONFIGURATIONS[key].server_args(s.total_bytes, 3, "p")
        assert pooled == [["--backend", backend, "--kv-cache-bytes", str(9 * 2**20), "--kv-pool", "p",
                           "--kv-pool-bytes", str(9 * 2**20)]] * 3
    assert CONFIGURATIONS["e"].label == "(e) elastic shared pool"
    for key, backend in (("b", "paged"), ("c", "vmm"), ("d", "reserve")):
        assert CONFIGURATIONS[key].server_args(s.total_bytes, 3, "p") == \
            [["--backend", backend, "--kv-cache-bytes", str(3 * 2**20)]] * 3


def test_odd_repeats_run_the_configurations_in_reverse():
    s = settings("--configurations", "a,c,b")
    assert [c.key for c in s.order(0)] == ["a", "c", "b"] and [c.key for c in s.order(1)] == ["b", "c", "a"]
    assert s.order(2) == s.order(0)


@pytest.mark.parametrize("argv, message", [
    (["--total-bytes", "1000000"], "must be a multiple of --engines x 64 KiB"),
    (["--total-bytes", "1TiB"], "--total-bytes"),
    (["--configurations", "b,c"], "including the baseline a"),
    (["--configurations", "a,f"], "distinct letters of a,b,c,d,e"),
    (["--configurations", "a,a"], "distinct letters"),
    (["--engines", "1"], "--engines must be an integer in [2, 16]"),
    (["--repeats", "0"], "--repeats must be an integer in [1, 100]"),
    (["--random-input-len", "250"], "exceeds --max-model-len 256"),
    (["--random-input-len", "9" * 400], "--random-input-len must be an integer in [1, 256]"),
    (["--max-model-len", "1"], "--max-model-len must be an integer"),
    (["--goodput", "ttft:nan"], "bad --goodput"),
    (["--idle-rate", "20"], "--idle-rate must be a finite number in [0, 6]"),
    (["--duty-cycle", "0"], "--duty-cycle"),
    (["--start-timeout", "inf"], "--start-timeout"),
    (["--server-args", "'unclosed"], "--server-args"),
    (["--out", "/proc/x/y"], "--out"),
    (["--seed", "-1"], "--seed"),
    (["--burst-rate", "0.01", "--periods", "1"], "gets no request"),
])
def test_bad_settings_are_one_line_before_any_server(capsys, argv, message):
    rc = cli.main(["study", "pool", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and message in err, err


def record(repeat: int, config: str, ttft: list[float], attained: list[float]) -> dict:
    return {"repeat": repeat, "configuration": config,
            "models": [{"p99_ttft_ms": t, "p99_tpot_ms": 10.0, "slo_attainment": a} for t, a in zip(ttft, attained)]}


def test_the_table_pairs_each_repeat_with_the_baseline():
    records = [record(0, "a", [100, 200], [1.0, 0.5]), record(0, "b", [150, 260], [0.9, 0.5]),
               record(1, "b", [400, 200], [0.5, 1.0]), record(1, "a", [300, 210], [1.0, 1.0]),
               record(2, "a", [200, 190], [1.0, 1.0]), record(2, "b", [230, 200], [1.0, 0.8])]
    rows = table.rows(records, ["a", "b"], models=2, baseline="a")
    assert [(r["model"], r["configuration"]) for r in rows] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    b0 = rows[1]
    assert b0["p99_ttft_ms"] == table.Spread(230, 150, 400)
    assert b0["p99_ttft_ms_vs_a"] == table.Spread(50, 30, 100)          # 50, 100, 30: paired, not 230 - 200
    assert rows[0]["p99_ttft_ms_vs_a"] is None
    assert rows[3]["slo_attainment_vs_a"] == table.Spread(0.0, pytest.approx(-0.2), 0.0)
    text = table.markdown(rows, {"a": "(a) pool", "b": "(b) paged"}, "a")
    assert "| 0 | (b) paged | 230 [150, 400] | +50 [+30, +100] |" in text
    assert "| 1 | (b) paged |" in text and "-20%" in text
    flat = table.csv_rows(rows, "a")
    assert flat[1]["p99_ttft_ms_vs_a_median"] == 50 and flat[0]["p99_ttft_ms_vs_a_median"] is None


def run_tiny_study(out, configurations: str, repeats: int, output_len: int = 8) -> int:
    """Two tiny engines on 4 MiB, one short burst each."""
    return cli.main(["study", "pool", "--engines", "2", "--total-bytes", "4MiB", "--configurations", configurations,
                     "--repeats", str(repeats), "--burst-rate", "4", "--period", "2", "--duty-cycle", "1",
                     "--periods", "1", "--random-input-len", "32", "--random-output-len", str(output_len), "--goodput",
                     "ttft:60000", "--out", str(out), "--no-progress"])


@pytest.mark.slow
def test_the_study_end_to_end_on_tiny_servers(tmp_path):
    """Two engines, the pool against the paged split, one short burst each, two repeats: the files, the table,
    the plot, and every pool gone after its servers."""
    out = tmp_path / "ab"
    assert run_tiny_study(out, "a,b", 2) == 0
    runs = json.loads((out / "runs.json").read_text())
    assert [(r["repeat"], r["configuration"]) for r in runs] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert all(m["completed"] == m["num_prompts"] for r in runs for m in r["models"])
    pooled = [r for r in runs if r["configuration"] == "a"]
    assert all(max(map(max, r["share_timeline"]["share"])) > 0 for r in pooled)
    assert "(b) paged static split" in (out / "table.md").read_text()
    assert (out / "shares.png").stat().st_size > 0 and (out / "table.csv").read_text().count("\n") == 5
    from kvlab.vmm.pool import UnknownPool, status
    with pytest.raises(UnknownPool):
        status(f"kvlab-ab-{os.getpid()}-0a")


@pytest.mark.slow
def test_elastic_servers_share_one_pool_end_to_end(tmp_path):
    """(e): two elastic servers on one pool beside (a), one short burst each, one repeat: every request served,
    each elastic engine's share read from the pool's books, and the pool gone after its servers. The outputs are
    long enough for a request to span the 0.2 s share samples: an elastic engine gives its pages back as soon as
    its requests end (a vmm engine parks them), so 8-token outputs could end between two samples."""
    out = tmp_path / "ae"
    assert run_tiny_study(out, "a,e", 1, output_len=128) == 0
    runs = {r["configuration"]: r for r in json.loads((out / "runs.json").read_text())}
    assert all(m["completed"] == m["num_prompts"] for m in runs["e"]["models"])
    assert all(max(share) > 0 for share in runs["e"]["share_timeline"]["share"])
    assert "(e) elastic shared pool" in (out / "table.md").read_text()
    assert "elastic on http" in (out / "logs" / "repeat0-e" / "server0.log").read_text()
    from kvlab.vmm.pool import UnknownPool, status
    with pytest.raises(UnknownPool):
        status(f"kvlab-ab-{os.getpid()}-0e")
