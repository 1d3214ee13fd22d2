"""`kvlab compare RUN_A RUN_B`: the configuration that differs first, then figure by figure with its spread."""
from __future__ import annotations

import pytest

from kvlab.experiments.cli.main import main
from kvlab.experiments.compare.diff import compare, differences, figure
from kvlab.experiments.compare.noise import unchanged_rows
from kvlab.experiments.compare.saved import SavedRun, load_run


def bench(out, page_size: str) -> None:
    assert main(["bench", "--model", "tiny", "--backends", "vmm,paged", "--num-requests", "4", "--scale", "0.05",
                 "--repeats", "1", "--warmup", "0", "--page-size", page_size, "--out", str(out),
                 "--no-progress"]) == 0


def test_compare_names_the_page_size_first(tmp_path, capsys):
    bench(tmp_path / "a", "8KiB")
    bench(tmp_path / "b", "16KiB")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    start, machine = lines.index("configuration differs (A -> B):"), lines.index("software and machine: the same")
    assert lines[start + 1] == "  engine.vmm.vmm.page_size: 8,192 -> 16,384", lines
    consequences = lines[start + 2:machine]          # the vmm cache as built from it, nothing else
    assert consequences and all(ln.startswith("  built.vmm.") for ln in consequences), consequences
    assert lines.index("figures (A -> B):") > machine


def test_compare_refuses_what_it_cannot_read(tmp_path, capsys):
    (tmp_path / "old.json").write_text('{"rows": []}')
    assert main(["compare", str(tmp_path / "none"), str(tmp_path / "old.json")]) == 2
    assert "no such results directory or file" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "old.json"), str(tmp_path / "old.json")]) == 2
    assert "records no provenance" in capsys.readouterr().err


@pytest.mark.parametrize("a, b, expect", [
    ([10.0, 12.0, 11.0], [11.5, 13.0, 12.5], "not distinguishable"),
    ([10.0, 11.0, 10.5], [20.0, 21.0, 22.0], "10.500 -> 21.000 (+100.0%"),
    ([5], [6], "5 -> 6 (+20.0%; one value each, no spread)"),
])
def test_a_figure_is_called_different_only_when_the_repeats_are_disjoint(a, b, expect):
    assert expect in figure("x", a, b, show_equal=False)


def test_differences_name_nested_settings_by_path_and_a_missing_table_once():
    a = {"engine": {"vmm": {"page_size": 1, "seed": 0}, "reserve": {"x": 1, "y": 2}}, "seed": 0}
    b = {"engine": {"vmm": {"page_size": 2, "seed": 0}}, "seed": 0}
    assert [(path, va) for path, va, _ in differences(a, b)] == [("engine.vmm.page_size", 1),
                                                                ("engine.reserve", {"x": 1, "y": 2})]


def page_size_pair(paged_b: list[float], vmm_b: list[float]) -> tuple[SavedRun, SavedRun]:
    """Two bench runs differing only in vmm's page size, as issue 40 found them (paged 339 -> 560 tok/s)."""
    def run(vmm_page: int, paged: list[float], vmm: list[float], load: float) -> SavedRun:
        config = {"engine": {"vmm": {"vmm": {"page_size": vmm_page}}, "paged": {"paged": {"block_size": 16}}}}
        record = {"config": config, "machine": {"load_average": [load, load, load], "logical_cpus": 2}}
        rows = {(("backend", name),): {"backend": name, "output_tokens_per_s": sorted(v)[1],
                                       "repeats_output_tokens_per_s": v, "preemptions": 3}
                for name, v in (("vmm", vmm), ("paged", paged))}
        return SavedRun(f"run-{vmm_page}", record, rows)
    return run(8192, [330.0, 339.0, 345.0], [300.0, 310.0, 320.0], 4.1), run(65536, paged_b, vmm_b, 9.8)


def test_the_unchanged_backend_is_a_noise_control_never_a_result():
    text = compare(*page_size_pair([550.0, 560.0, 575.0], [450.0, 470.0, 480.0]))
    assert "disjoint" not in text and "machine load (1-min load average at the start, 2 CPUs): A 4.10 -> B 9.80" \
        in text
    assert "noise control: paged ran the same configuration in A and B" in text
    paged = text.split("paged (noise control):")[1].splitlines()[1]
    assert "this is noise, not a result" in paged and "significantly" not in paged
    vmm = text.split("  vmm:")[1].splitlines()[1]         # +51.6% against paged's +65.2%: within the noise
    assert vmm.startswith("    output_tokens_per_s: not distinguishable") and "within the noise controls' 65.2%" in vmm


def test_a_change_beyond_the_noise_control_is_called_real():
    text = compare(*page_size_pair([335.0, 340.0, 350.0], [450.0, 470.0, 480.0]))
    vmm = text.split("  vmm:")[1].splitlines()[1]
    assert "significantly higher in B" in vmm and "beyond the noise controls' 0.3%" in vmm


def test_rows_owning_no_changed_setting_are_the_controls():
    keys = [(("backend", "vmm"),), (("backend", "paged"),)]
    assert unchanged_rows(keys, ["engine.vmm.vmm.page_size", "built.vmm.pages"]) == [keys[1]]
    assert unchanged_rows(keys, ["workload.num_requests"]) == []
    assert unchanged_rows(keys, []) == keys


def test_compare_reads_study_and_fleet_results(tmp_path):
    import json
    study = {"settings": {"requests": 100}, "cells": {"h100": {"units": {"vmm-256KiB": {
        "slo_rate": 31.5, "slo_rate_ci95": [24.7, 42.9], "output_throughput": 2080,
        "output_throughput_ci95": [2000, 2100], "ratio_to_best_paged": {"ratio": 0.865, "ci95": [0.823, 0.947]}}}}}}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "study.json").write_text(json.dumps(study))
    run = load_run(str(tmp_path / "s"))
    row = run.rows[(("cell", "h100"), ("unit", "vmm-256KiB"))]
    assert row["slo_rate_ci95"] == [24.7, 42.9] and "study.json's settings" in run.provenance["note"]
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "provenance.json").write_text(json.dumps({"config": {"command": "simulate pool"}}))
    (tmp_path / "p" / "sim_pool.json").write_text(json.dumps({"result": {"runs": [
        {"arrangement": "shared:vmm-2MiB", "request_rate": 8, "seed": 0, "p99_ttft_ms": 10.0}]}}))
    assert list(load_run(str(tmp_path / "p")).rows.values())[0]["p99_ttft_ms"] == 10.0
