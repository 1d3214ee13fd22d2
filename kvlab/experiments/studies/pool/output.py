"""What a pool A/B leaves in its results directory: provenance.json, runs.json (every run's per-model blocks,
requests and samples), table.md and table.csv, and shares.png (the first repeat, one panel per configuration)."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from kvlab.experiments.loadgen.shares import plot_shares
from kvlab.experiments.reporting.provenance import jsonable, provenance, write_provenance
from kvlab.experiments.studies.pool import table
from kvlab.experiments.studies.pool.settings import BASELINE, PoolStudySettings


def report(s: PoolStudySettings, records: list[dict[str, Any]]) -> str:
    labels = {c.key: c.label for c in s.configurations}
    rows = table.rows(records, [c.key for c in s.configurations], s.engines, BASELINE)
    return table.markdown(rows, labels, BASELINE)


def save(s: PoolStudySettings, records: list[dict[str, Any]], out: Path, text: str, command: str) -> Path:
    write_provenance(out, provenance({"command": command, "settings": s}))
    (out / "runs.json").write_text(json.dumps(jsonable(records), indent=1))
    (out / "table.md").write_text(text + "\n")
    rows = table.csv_rows(table.rows(records, [c.key for c in s.configurations], s.engines, BASELINE), BASELINE)
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return share_plot(s, records, out / "shares.png")


def share_plot(s: PoolStudySettings, records: list[dict[str, Any]], path: Path) -> Path:
    first = {r["configuration"]: r for r in records if r["repeat"] == 0}
    panels = [(f"{c.label}: each engine's share of {s.total_bytes / 2**20:g} MiB", first[c.key]["share_timeline"])
              for c in s.configurations if c.key in first]
    bursts = [s.multi.phases.bursts(i) for i in range(s.engines)]
    return plot_shares(path, panels, [f"model {i}" for i in range(s.engines)], bursts)
