"""A saved run as `kvlab compare` reads it: its provenance and its rows (one per backend, policy or case), from
every results file kvlab writes: bench (results.json), bench serve (serve.json), simulate (rows.json), simulate
serve / pool / pd (sim_serve.json, sim_pool.json, sim_pd.json) and the page-size study (study.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.reporting.provenance import read_provenance

# The results file of each writer, in the order a directory is searched.
RESULT_FILES = ("results.json", "serve.json", "sim_serve.json", "sim_pool.json", "sim_pd.json", "rows.json",
                "study.json")
IDENTITY = ("backend", "arrangement", "setup", "cell", "unit", "label", "policy", "mode", "width", "request_rate",
            "budget_gb", "watermark", "seed")


@dataclass(frozen=True, slots=True)
class SavedRun:
    path: Path
    provenance: dict[str, Any]
    rows: dict[tuple, dict[str, Any]]        # identity (IDENTITY values present) -> the row


def load_run(where: str) -> SavedRun:
    path = Path(where)
    if not path.exists():
        raise ConfigError(f"{where}: no such results directory or file")
    file = results_file(path)
    doc = read_json(file)
    record = read_provenance(path) or read_provenance(file) or read_provenance(file.parent) or settings_record(doc)
    if record is None:
        raise ConfigError(f"{where} records no provenance (written before kvlab recorded it?); cannot compare "
                          "configurations")
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: its provenance is not a JSON object (got {type(record).__name__})")
    return SavedRun(path, record, {identity(r): r for r in rows_of(doc)})


def results_file(path: Path) -> Path:
    if path.is_file():
        return path
    found = next((path / name for name in RESULT_FILES if (path / name).is_file()), None)
    if found is None:
        raise ConfigError(f"{path} holds no results file ({', '.join(RESULT_FILES)})")
    return found


def read_json(file: Path) -> dict[str, Any]:
    try:
        doc = json.loads(file.read_text())
    except (ValueError, RecursionError) as e:        # RecursionError: nested thousands of levels deep
        raise ConfigError(f"{file} is not JSON: {str(e)[:120]}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{file} is not a kvlab results file (a JSON object)")
    return doc


def settings_record(doc: dict[str, Any]) -> dict[str, Any] | None:
    """A study.json written without provenance.json: its settings stand in for the configuration."""
    if isinstance(doc.get("settings"), dict) and isinstance(doc.get("cells"), dict):
        return {"config": doc["settings"], "note": "no provenance.json: configuration from study.json's settings"}
    return None


def rows_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    result = doc.get("result") if isinstance(doc.get("result"), dict) else {}
    rows = doc.get("runs", doc.get("rows", result.get("runs", result.get("searches"))))
    if rows is None and isinstance(doc.get("cells"), dict):
        rows = study_rows(doc["cells"])
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def study_rows(cells: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (cell, unit) of the page-size study, each figure with its 95% interval as `<figure>_ci95`."""
    rows = []
    for label, cell in cells.items():
        for unit, u in (cell.get("units") or {}).items():
            ratio = u.get("ratio_to_best_paged") or {}
            rows.append({"cell": label, "unit": unit, "slo_rate": u.get("slo_rate"),
                         "slo_rate_ci95": u.get("slo_rate_ci95"), "output_throughput": u.get("output_throughput"),
                         "output_throughput_ci95": u.get("output_throughput_ci95"),
                         "ratio_to_best_paged": ratio.get("ratio"), "ratio_to_best_paged_ci95": ratio.get("ci95")})
    return rows


def identity(row: dict[str, Any]) -> tuple:
    bad = next((k for k in IDENTITY if k in row and not isinstance(row[k], (str, int, float, bool, type(None)))),
               None)
    if bad is not None:
        raise ConfigError(f"a row's {bad} must be text or a number, got {type(row[bad]).__name__}")
    return tuple((k, row[k]) for k in IDENTITY if k in row)
