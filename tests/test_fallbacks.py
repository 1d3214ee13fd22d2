"""The fallback study: grid size, the example findings, the saved files and the --measure machinery."""
from __future__ import annotations

import argparse
import csv
import json
from dataclasses import replace

import pytest
import torch

from kvlab.common.attention.declarations import REGISTRY
from kvlab.common.attention.rules import Environment
from kvlab.common.attention.spec import AttentionSpec
from kvlab.experiments.studies import fallbacks
from kvlab.experiments.studies.fallbacks import grid as grid_module
from kvlab.experiments.studies.fallbacks import summary, timing
from kvlab.experiments.studies.fallbacks.decisions import CAUSES
from kvlab.experiments.studies.fallbacks.grid import Grid, default_scenarios, run_grid


@pytest.fixture(scope="module")
def rows():
    return run_grid(Grid(), default_scenarios())


@pytest.fixture(scope="module")
def index(rows):
    return {grid_module.row_key(r): r for r in rows}


def test_grid_has_one_row_per_point_backend_phase(rows):
    grid = Grid()
    paged = 9 * 3 * 7 * 4      # head dims x dtypes x block sizes x GQA ratios, for paged and for elastic
    vmm = 9 * 3 * 4            # the contiguous layout has no block size
    assert grid.num_rows(3) == 3 * 2 * (2 * paged + vmm) == 9720
    assert len(rows) == grid.num_rows(3)
    assert len({grid_module.row_key(r) for r in rows}) == len(rows)


def test_every_fallback_names_what_it_displaced_and_why(rows):
    for r in rows:
        assert r.fallback == bool(r.displaced)
        assert set(r.displaced) == set(r.reasons) and all(r.reasons.values())
        assert set(r.causes) <= set(CAUSES)
        assert r.kernel not in r.refused
        assert (r.kernel == r.preferred) != r.fallback


def test_elastic_is_decided_and_counted_like_paged(rows):
    """elastic runs paged's kernels through paged's storage: at every point and scenario it gets paged's kernel,
    displaces the same kernels for the same reasons, and its fallbacks are counted beside paged's."""
    assert grid_module.layout_backends() == {"paged": "paged", "vmm": "contiguous", "elastic": "paged"}
    elastic = {grid_module.row_key(r)[2:]: r for r in rows if r.backend == "elastic"}
    paged = {grid_module.row_key(r)[2:]: r for r in rows if r.backend == "paged"}
    assert set(elastic) == set(paged)
    for key, p in paged.items():
        e = elastic[key]
        assert (e.layout, e.kernel, e.fallback, e.reasons, e.refused) == (p.layout, p.kernel, p.fallback,
                                                                          p.reasons, p.refused)
    counts = summary.cause_counts(rows)
    assert counts["cuda", "elastic"] == counts["cuda", "paged"] and counts["cuda", "elastic"]["fallbacks"] > 0
    text = summary.format_summary(rows, default_scenarios(), Grid())
    assert "backends paged, vmm, elastic" in text and "paged+elastic decode" in text


def test_cpu_never_falls_back(rows):
    cpu = [r for r in rows if r.scenario == "cpu"]
    assert {r.kernel for r in cpu if r.backend in ("paged", "elastic")} == {"torch_paged"}
    assert {r.kernel for r in cpu if r.backend == "vmm"} == {"torch_sdpa_contiguous"}
    assert not any(r.fallback for r in cpu)


def test_finding_head_dim_80(index):
    padded = index[("cuda+fa+fi", "paged", "decode", 80, "bfloat16", 256, "auto", 4)]
    assert (padded.kernel, padded.kernel_head_dim, padded.fallback) == ("flash_attn_paged", 96, False)
    small = index[("cuda+fa+fi", "paged", "decode", 80, "bfloat16", 16, "auto", 4)]
    assert small.kernel == "triton_paged" and small.displaced == ["flash_attn_paged", "flashinfer_paged"]
    assert any("head_size 80 not supported" in x for x in small.reasons["flashinfer_paged"])
    assert small.causes == ["head_dim", "block_size"]


def test_finding_fp32(index):
    paged = index[("cuda+fa+fi", "paged", "decode", 128, "float32", 256, "auto", 4)]
    assert paged.kernel == "triton_paged" and paged.causes == ["dtype"]
    vmm = index[("cuda+fa+fi", "vmm", "decode", 128, "float32", None, "auto", 4)]
    assert vmm.kernel == "torch_sdpa_contiguous" and vmm.displaced == ["flash_attn_contiguous"]
    assert vmm.reasons["flash_attn_contiguous"] == [
        "dtype float32 not supported (flash-attn: float16, bfloat16)"]


def test_finding_block_16_refused_by_upstream_flash_attn(index):
    r = index[("cuda+fa+fi", "paged", "prefill", 128, "bfloat16", 16, "auto", 4)]
    assert r.kernel == "flashinfer_paged" and r.displaced == ["flash_attn_paged"]
    assert r.reasons["flash_attn_paged"][0].startswith(
        "block_size 16 not supported: page size must be a multiple of 256")


def test_finding_missing_package(index):
    r = index[("cuda", "paged", "decode", 128, "bfloat16", 256, "auto", 4)]
    assert r.kernel == "triton_paged" and r.causes == ["package"]
    assert r.reasons["flash_attn_paged"] == ["ImportError: package 'flash_attn' is not installed"]


def test_summary_calls_out_the_findings(rows):
    text = summary.format_summary(rows, default_scenarios(), Grid())
    assert "9,720 decisions" in text
    for needle in ("head_dim 80", "an fp32 model", "block size 16 refused", "a missing package",
                   "computes with head_dim 96", "ImportError: package 'flash_attn' is not installed",
                   "GQA ratio changed the kernel at 0"):
        assert needle in text, needle
    assert len(summary.findings(rows)) == len(summary.FINDINGS)


def test_cli_saves_json_csv_png(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    fallbacks.add_parser(parser.add_subparsers())
    args = parser.parse_args(["fallbacks", "--out", str(tmp_path), "--head-dims", "64,80", "--dtypes",
                              "float32,bfloat16", "--block-sizes", "16,256", "--gqa-ratios", "4"])
    assert args.run(args) == 0
    expected = Grid((64, 80), ("float32", "bfloat16"), (16, 256), (4,)).num_rows(3)
    data = json.loads((tmp_path / "fallbacks.json").read_text())
    assert len(data["rows"]) == expected and data["meta"]["grid"]["head_dims"] == [64, 80]
    with (tmp_path / "fallbacks.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == expected and set(table[0]) >= {"kernel", "displaced", "reasons", "causes"}
    assert (tmp_path / "fallbacks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Example findings" in capsys.readouterr().out


def test_cli_rejects_a_bad_grid(tmp_path):
    from kvlab.common.errors import ConfigError
    parser = argparse.ArgumentParser()
    fallbacks.add_parser(parser.add_subparsers())
    args = parser.parse_args(["fallbacks", "--out", str(tmp_path), "--dtypes", "float8"])
    with pytest.raises(ConfigError, match="dtypes must be"):
        args.run(args)


# -- --measure -----------------------------------------------------------------------------------------------
CASES = [("paged", timing.Shape(3, 37, 1)), ("paged", timing.Shape(2, 40, 9)),
         ("contiguous", timing.Shape(3, 21, 5))]


@pytest.mark.parametrize("layout,shape", CASES)
def test_measured_cases_follow_the_kernel_contract(layout, shape):
    s = timing.spec_for(layout, "cpu", None, "float32", 32, block_size=8)
    case = timing.build_case(s, shape)
    assert case.q.shape == (shape.batch * shape.query, s.num_q_heads, 32)
    assert case.meta.phase == ("decode" if shape.query == 1 else "prefill")
    if layout == "paged":
        assert case.k_cache.shape[1:] == (8, 2, 32) and case.meta.block_tables.dtype == torch.int32
        assert case.meta.slot_mapping.dtype == torch.int64
        # the slot mapping points at the cached K of each query's own position
        k_flat = case.k_cache.view(-1, 2, 32)
        last = case.meta.slot_mapping.view(shape.batch, shape.query)[:, -1]
        seq0_block = case.meta.block_tables[0, (shape.context - 1) // 8]
        assert int(last[0]) == int(seq0_block) * 8 + (shape.context - 1) % 8
        assert k_flat[last].shape == (shape.batch, 2, 32)
    else:
        assert case.k_cache.shape[1:] == (shape.context, 2, 32) and case.meta.slots.shape == (shape.batch,)


def test_timer_checks_results_against_dense_attention():
    timer = timing.Timer(repeats=2, device="cpu")
    torch_paged = timing.by_name("torch_paged")
    s = timing.spec_for("paged", "cpu", None, "float32", 64)
    row = timer.run(torch_paged, s, "prefill", timing.Shape(2, 48, 16))
    assert "error" not in row and row["max_abs_err"] < 1e-4 and row["median_ms"] > 0
    refused = timer.run(timing.by_name("flash_attn_paged"), s, "decode", timing.TINY["decode"])
    assert "device cpu not supported" in refused["error"]


def test_nearest_accepted_config():
    fa = next(d for d in REGISTRY if d.name == "flash_attn_paged")
    grid = {"block_sizes": Grid().block_sizes, "head_dims": Grid().head_dims}
    base = AttentionSpec("paged", "cuda", "float32", 100, 8, 2, 16, (9, 0))
    everything = replace(fa, installed=lambda package: True)
    near, why = timing.nearest_accepted(everything, base, "prefill", grid)
    assert (near.dtype, near.block_size, near.head_dim, why) == ("bfloat16", 256, 112, "")
    near, why = timing.nearest_accepted(replace(fa, installed=lambda package: False), base, "decode", grid)
    assert near is None and why == "ImportError: package 'flash_attn' is not installed"


@pytest.mark.triton_cpu
def test_measure_on_this_machine(rows, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(timing, "HEAD_DIMS", (64,))
    small = {"decode": timing.Shape(2, 64, 1), "prefill": timing.Shape(1, 48, 16)}
    monkeypatch.setattr(timing, "SHAPES", small)
    result = timing.measure(rows, threads=1, repeats=1, progress=False)
    assert result["device"] == "cpu" and result["fallback_costs"] == []
    timed = {(t["kernel"], t["phase"], t["dtype"]) for t in result["timings"] if "median_ms" in t}
    assert {("torch_paged", "decode", "float32"), ("torch_paged", "prefill", "bfloat16"),
            ("triton_paged", "decode", "float32")} <= timed
    assert all(t.get("max_abs_err", 0) <= timing.TOLERANCE[t["dtype"]] for t in result["timings"])
    text = timing.format_timings(result)
    assert "none: no kernel is displaced on cpu" in text
    assert "triton_paged (interpreted) / torch_paged" in text
    assert Environment().interpreting_triton()


@pytest.mark.triton_cpu
def test_fallback_cost_times_chosen_against_displaced(monkeypatch):
    """A fallback whose displaced kernel runs here gets a measured ratio; one that cannot says why."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(timing, "SHAPES", dict(timing.TINY))
    shared = {"device": "cpu", "compute_capability": None, "packages": [], "backend": "paged",
              "layout": "paged", "phase": "decode", "head_dim": 64, "dtype": "float32", "block_size": 16,
              "gqa_ratio": 4, "num_q_heads": 8, "num_kv_heads": 2, "kernel": "torch_paged",
              "kernel_head_dim": 64, "fallback": True}
    rows = [grid_module.Row(scenario="what-if", preferred="triton_paged", displaced=["triton_paged"],
                          reasons={"triton_paged": ["device cpu needs TRITON_INTERPRET=1"]}, **shared),
            grid_module.Row(scenario="cuda-ish", preferred="flash_attn_paged", displaced=["flash_attn_paged"],
                          reasons={"flash_attn_paged": ["dtype float32 not supported"]}, **shared)]
    grid = {"block_sizes": Grid().block_sizes, "head_dims": Grid().head_dims}
    timer = timing.Timer(repeats=1, device="cpu")
    [measured] = timing.fallback_costs(timer, rows, "what-if", grid, "cpu", None)
    assert measured["chosen"] == "torch_paged" and measured["displaced"] == "triton_paged"
    assert measured["cost"] is not None and measured["cost"] < 1   # the interpreter is far slower than torch
    timed = len(timer.results)
    rows += [replace(r, backend="elastic") for r in rows]
    paged, elastic = timing.fallback_costs(timer, rows, "what-if", grid, "cpu", None)
    assert len(timer.results) == timed + 2          # one chosen/displaced pair: elastic's path is not timed again
    assert (elastic["backend"], elastic["cost"]) == ("elastic", paged["cost"])
    [na] = timing.fallback_costs(timer, rows[:2], "cuda-ish", grid, "cpu", None)
    assert na["cost"] is None and na["why"].startswith("flash_attn_paged cannot run here: ")
    assert "device cpu not supported" in na["why"]
    assert "instead of flash_attn_paged" in timing.format_timings(
        {"device": "cpu", "threads": 1, "repeats": 1, "notes": [], "timings": timer.results,
         "fallback_costs": [measured, na], "scenario": "what-if"})


def test_kvlab_cli_runs_the_study(tmp_path, capsys):
    from kvlab.experiments.cli import main as cli
    small = ["--head-dims", "80", "--gqa-ratios", "4"]
    assert cli.main(["fallbacks", "--no-plot", "--out", str(tmp_path), *small]) == 0
    assert (tmp_path / "fallbacks.json").exists()
    assert cli.main(["fallbacks", "--no-plot", "--out", str(tmp_path), "--gqa-ratios", "0"]) == 2
    assert "kvlab fallbacks: error: fallbacks grid" in capsys.readouterr().err
