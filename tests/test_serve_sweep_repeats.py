"""`kvlab bench serve --backends`: interleaved repeats per cell, the spread and verdict per cell, and a sweep that
keeps its finished runs when interrupted and finishes them with --resume. The servers here are the stub of
test_serve_bench.py (one per "backend"), so the sweep's logic runs in about a second."""
from __future__ import annotations

import contextlib
import json

import pytest
from test_serve_bench import stub  # noqa: F401  (the stub server fixture)

from kvlab.experiments.cli import main as cli
from kvlab.experiments.loadgen import cells, sweep
from kvlab.experiments.reporting.verdict import HIGHER, LOWER, SAME

SWEEP = ["bench", "serve", "--backends", "vmm,paged", "--request-rates", "8,inf", "--num-prompts", "2",
         "--dataset", "random", "--input-len", "4", "--output-len", "3", "--token-ids"]   # ids: no tokenizer to load


@pytest.fixture
def no_plots(monkeypatch):
    """The report's plots take seconds on a loaded machine; the tests that do not read them skip them."""
    from kvlab.experiments.loadgen import report
    monkeypatch.setattr(report, "plot", lambda out, cells: [])
    monkeypatch.setattr(report, "plot_timelines", lambda out, rows: [])


@pytest.fixture
def stub_servers(stub, monkeypatch):  # noqa: F811
    """Every backend's `kvlab serve` replaced by the stub; bench_once's calls recorded as (backend, rate)."""
    started, calls = [], []

    @contextlib.contextmanager
    def fake_server(backend, model, extra):
        started.append(backend)
        yield f"{stub}/{backend}"

    real = sweep.bench_once

    def recorded(spec, url, rate, **kw):
        calls.append((url.rsplit("/", 1)[1], rate))
        return real(spec, url.rsplit("/", 1)[0], rate, **kw)
    monkeypatch.setattr(sweep, "kvlab_server", fake_server)
    monkeypatch.setattr(sweep, "bench_once", recorded)
    monkeypatch.setattr(sweep, "server_counter", lambda url, name: 0.0)
    return started, calls


def test_rounds_alternate_order_and_every_cell_gets_a_spread_and_verdict(stub_servers, tmp_path, capsys):
    started, calls = stub_servers
    rc = cli.main([*SWEEP[:5], "inf", *SWEEP[6:], "--out", str(tmp_path)])    # default: 3 repeats, two backends
    out = capsys.readouterr().out
    assert rc == 0 and started == ["vmm", "paged"]             # each server started once, for the whole sweep
    assert [b for b, _ in calls] == ["vmm", "paged", "paged", "vmm", "vmm", "paged"]
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert [(r["backend"], r["repeat"]) for r in saved["runs"][:3]] == [("vmm", 0), ("paged", 0), ("paged", 1)]
    assert [(c["backend"], c["runs"]) for c in saved["cells"]] == [("vmm", 3), ("paged", 3)]
    for c in saved["cells"]:
        t = c["output_throughput"]
        assert t["low"] <= t["mid"] <= t["high"]
    verdicts = [v for c in saved["cells"] for v in c.get("verdicts", [])]
    assert len(verdicts) == 2 and all(any(w in v for w in (HIGHER, LOWER, SAME)) for v in verdicts)
    assert "paged" in out and "(median [min-max])" in out and verdicts[0] in out
    page = (tmp_path / "report.html").read_text()
    first_plot, config = page.index("<img"), page.index("configuration</summary>")
    assert page.index("Verdicts") < page.index("median [min-max]") < first_plot < config
    assert page.index("<details>") < config and 'alt="serve_throughput"' in page and 'alt="serve_ttft"' in page


def test_an_interrupted_sweep_leaves_partial_txt_and_resume_runs_only_the_rest(stub_servers, no_plots, tmp_path,
                                                                              monkeypatch, capsys):
    started, calls = stub_servers
    recorded = sweep.bench_once

    def stop_on_the_fourth(spec, url, rate, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt
        return recorded(spec, url, rate, **kw)
    monkeypatch.setattr(sweep, "bench_once", stop_on_the_fourth)
    assert cli.main([*SWEEP, "--repeats", "2", "--out", str(tmp_path)]) == 130
    partial = (tmp_path / "partial.txt").read_text()
    assert "interrupted after 3 of 8 points" in partial and f"--resume {tmp_path}" in partial
    assert "paged rate 8 repeat 1" in partial and not (tmp_path / "serve.json").exists()
    monkeypatch.setattr(sweep, "bench_once", recorded)
    calls.clear()
    assert cli.main(["bench", "serve", "--resume", str(tmp_path)]) == 0
    assert calls == [("vmm", 8), ("vmm", float("inf")), ("paged", float("inf")), ("paged", float("inf")),
                     ("vmm", float("inf"))]
    runs = json.loads((tmp_path / "serve.json").read_text())["runs"]
    assert len(runs) == 8 and not (tmp_path / "partial.txt").exists()
    assert "3 run(s) from an earlier start" in capsys.readouterr().out


def test_a_resume_with_another_configuration_is_refused(stub_servers, no_plots, tmp_path, capsys):
    assert cli.main([*SWEEP[:5], "inf", *SWEEP[6:], "--repeats", "1", "--out", str(tmp_path)]) == 0
    rc = cli.main(["bench", "serve", "--resume", str(tmp_path), "--num-prompts", "3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "configuration" in err


def test_repeats_and_resume_belong_to_the_sweep(stub, tmp_path, capsys):  # noqa: F811
    for extra in (["--repeats", "3"], ["--resume", str(tmp_path)]):
        rc = cli.main(["bench", "serve", "--base-url", stub, "--num-prompts", "1", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1
        assert ("belong to the sweep" if extra[0] == "--repeats" else "no checkpoint.json there") in err
    assert cli.main([*SWEEP, "--repeats", "0"]) == 2 and "--repeats" in capsys.readouterr().err


def run_row(backend: str, repeat: int, throughput: float, ttft: float) -> dict:
    return {"backend": backend, "request_rate": 4.0, "repeat": repeat, "output_throughput": throughput,
            "p50_ttft_ms": ttft}


def test_cell_verdicts_come_from_the_one_verdict_function():
    rows = [run_row("vmm", r, t, 50.0 + r) for r, t in enumerate((100.0, 104.0, 98.0))]
    rows += [run_row("paged", r, t, 51.0 - r) for r, t in enumerate((120.0, 125.0, 118.0))]
    vmm, paged = cells.cells_of(rows)
    assert vmm["output_throughput"] == {"low": 98.0, "mid": 100.0, "high": 104.0} and "verdicts" not in vmm
    assert paged["verdicts"] == ["paged is significantly higher than vmm in output tok/s",
                                 "paged and vmm are not distinguishable in p50 TTFT"]
    two = cells.cells_of([r for r in rows if r["repeat"] < 2])
    assert all("not judged, 2 run(s) each" in v for v in two[1]["verdicts"])
    assert cells.shown(vmm["output_throughput"]) == "100 [98-104]"
