"""`kvlab bench handoff` end to end on tiny contexts (a subprocess: the run pins itself to one core), and its flags'
one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlab.experiments.cli.main import main


def test_the_handoff_table_has_every_cell_and_vmm_copies_nothing(tmp_path):
    out = tmp_path / "handoff"
    done = subprocess.run([sys.executable, "-m", "kvlab.experiments.cli.main", "bench", "handoff", "--contexts",
                           "64,300", "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    doc = json.loads((out / "handoff.json").read_text())
    cells = {(r["backend"], r["context"]): r for r in doc["rows"]}
    assert set(cells) == {(b, c) for b in ("vmm", "paged", "reserve") for c in (64, 300)}
    assert all(len(r["latency_ms"]) == 2 and r["latency_ms_median"] > 0 for r in doc["rows"])
    for context in (64, 300):
        kv_bytes = cells["paged", context]["kv_bytes"]
        assert cells["vmm", context]["bytes_copied"] == 0 and cells["vmm", context]["unit"] == "page"
        reserve = cells["reserve", context]
        assert reserve["bytes_copied"] == kv_bytes == reserve["prefill_bytes_copied"]
        assert reserve["units_moved"] == context
        assert cells["paged", context]["bytes_copied"] >= kv_bytes             # whole blocks
    assert cells["vmm", 300]["units_moved"] > cells["vmm", 64]["units_moved"]
    assert doc["provenance"]["config"]["command"] == "bench handoff"
    assert (out / "provenance.json").is_file() and "| tiny | vmm | 64 |" in (out / "handoff.md").read_text()


@pytest.mark.parametrize("argv, match", [
    (["--contexts", "1"], "--contexts"),
    (["--contexts", "a,b"], "--contexts"),
    (["--repeats", "0"], "--repeats"),
    (["--cpu", "-1"], "--cpu"),
])
def test_bad_flags_are_one_line_errors(argv, match, capsys):
    assert main(["bench", "handoff", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1
