"""The fallback study's files: every decision as JSON and CSV, and the summary text."""
from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvlab.experiments.studies.fallbacks.grid import Row, Scenario

CSV_FIELDS = list(Row.__dataclass_fields__)


def csv_value(value: Any) -> Any:
    if isinstance(value, list):
        return ";".join(map(str, value))
    if isinstance(value, dict):
        return " | ".join(f"{k}: {', '.join(v)}" for k, v in value.items())
    return "" if value is None else value


def save(rows: list[Row], out: Path, summary: str, meta: dict[str, Any]) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "fallbacks.json", "csv": out / "fallbacks.csv", "summary": out / "summary.txt"}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: csv_value(v) for k, v in asdict(r).items()})
    paths["summary"].write_text(summary + "\n")
    return paths


def scenario_meta(s: Scenario) -> dict[str, Any]:
    return {"name": s.name, "label": s.label, "device": s.device, "compute_capability": s.compute_capability,
            "packages": sorted(s.env.packages or ()), "triton_interpret": s.env.interpreting_triton()}
