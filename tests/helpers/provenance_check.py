"""What every results file must record about where it came from (experiments/reporting/provenance.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def check_provenance(record: dict[str, Any], command: str) -> dict[str, Any]:
    """The resolved configuration of `command`, kvlab's version and commit, torch, the machine; returns the config."""
    assert record["config"]["command"] == command
    assert record["kvlab"]["version"] and "commit" in record["kvlab"]
    assert record["torch"]
    machine = record["machine"]
    assert machine["cpu"] and machine["logical_cpus"] >= 1 and "gpu" in machine
    return record["config"]


def read_back(out: Path, results: str, command: str) -> dict[str, Any]:
    """A results directory's provenance.json, equal to the one inside its JSON results file; returns the config."""
    record = json.loads((out / "provenance.json").read_text())
    assert json.loads((out / results).read_text())["provenance"] == record
    return check_provenance(record, command)
