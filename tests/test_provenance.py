"""experiments/reporting/provenance.py: what every results file records, and the sharing study's writer (the
other writers' read-backs sit beside their own tests: test_bench, test_simulate, test_results_dir,
test_sim_serve, test_vmm_prefix_workloads, test_serve_bench)."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
from helpers.provenance_check import check_provenance, read_back

from kvlab.experiments.cli.main import main
from kvlab.experiments.reporting.provenance import jsonable, provenance, read_provenance, rows_json, source_revision


def test_a_record_names_the_commit_of_this_checkout_and_holds_json_only():
    record = provenance({"command": "x", "shape": (1, 2), "where": dataclasses.make_dataclass("P", ["a"])(a=1)})
    assert check_provenance(record, "x") == {"command": "x", "shape": [1, 2], "where": {"a": 1}}
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", source_revision() or ""), source_revision()
    assert json.loads(json.dumps(record)) == record
    assert jsonable({1: {3}}) == {"1": [3]}


@pytest.mark.parametrize("doc", [{"meta": {"a": [1, 2]}, "runs": [{"x": [1, 2.5]}, {"y": None}]},
                                 {"runs": []}, {"runs": ["one"]}, {"meta": {}, "runs": []}])
def test_a_results_file_with_rows_reads_back_whole_one_row_per_line(doc):
    text = rows_json(doc, "runs")
    assert json.loads(text) == doc
    assert [json.loads(line.rstrip(",")) for line in text.splitlines()[-2 - len(doc["runs"]):-2]] == doc["runs"]


def test_a_run_that_never_loaded_torch_records_it_without_loading_it():
    """The simulators never use torch: their record reads the installed version instead of paying its import."""
    import subprocess
    import sys
    code = ("import json, sys; from kvlab.experiments.reporting.provenance import provenance; "
            "r = provenance({'command': 'x'}); print(json.dumps([r, 'torch' in sys.modules]))")
    record, loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                               check=True, timeout=60).stdout)
    import torch
    assert not loaded and record["torch"] == torch.__version__      # the package's version is the module's
    assert record["machine"]["torch_threads"] is None and check_provenance(record, "x") == {"command": "x"}


def test_read_provenance_from_a_directory_or_a_results_file(tmp_path):
    record = provenance({"command": "x"})
    (tmp_path / "provenance.json").write_text(json.dumps(record))
    (tmp_path / "rows.json").write_text(json.dumps({"provenance": record, "rows": []}))
    assert read_provenance(tmp_path) == record == read_provenance(tmp_path / "rows.json")
    (tmp_path / "old.json").write_text('{"rows": []}')
    assert read_provenance(tmp_path / "old.json") is None and read_provenance(tmp_path / "none") is None


def test_sharing_records_provenance(tmp_path):
    assert main(["sharing", "--num-requests", "2", "--widths", "2", "--modes", "parallel", "--scale", "0.2",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    config = read_back(tmp_path, "rows.json", "sharing")
    assert set(config["engine"]) == {"paged width 2", "vmm width 2"} and config["workload"]["num_requests"] == 2
    paged, vmm = config["engine"]["paged width 2"], config["engine"]["vmm width 2"]
    assert vmm["vmm"]["page_size"] == paged["paged"]["block_size"] * 512     # tiny fp32: 512 B per token and layer
