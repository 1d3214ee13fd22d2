"""The study's files in results/<timestamp>/ or --out: provenance.json (written first), searches.jsonl (each
search as it finishes: journal.py), study.json (settings, every search, the summaries, curves and verdict),
study.csv (one row per cell and unit at the profile's own costs), curve.csv (one row per cell, kernel ratio and
vmm unit), study.png (SLO rate against tokens per unit), curve.png (vmm/paged against the kernel ratio, the
published figures marked) and report.txt."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from kvlab.experiments.studies.page_size.settings import StudySettings

CSV_KEYS = ("cell", "unit", "tokens_per_unit", "slo_rate_req_per_s", "slo_rate_ci95_low_req_per_s",
            "slo_rate_ci95_high_req_per_s", "output_throughput_tok_per_s", "output_throughput_ci95_low_tok_per_s",
            "output_throughput_ci95_high_tok_per_s", "rate_ratio_to_best_paged", "rate_ratio_ci95_low",
            "rate_ratio_ci95_high")
CURVE_KEYS = ("cell", "kernel_ratio_paged_over_contiguous", "best_paged", "vmm_unit", "rate_ratio_vmm_over_paged",
              "rate_ratio_ci95_low", "rate_ratio_ci95_high")


def finite(x: float | None) -> float | str | None:
    """JSON holds no infinity: an open end is written "inf"."""
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def csv_rows(cells: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, cell in cells.items():
        for unit, u in cell["units"].items():
            ratio = u["ratio_to_best_paged"]
            values = (label, unit, u["tokens_per_unit"], u["slo_rate"], *u["slo_rate_ci95"], u["output_throughput"],
                      *u["output_throughput_ci95"], ratio["ratio"], *ratio["ci95"])
            rows.append(dict(zip(CSV_KEYS, map(finite, values))))
    return rows


def curve_rows(cells: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, cell in cells.items():
        for p in (cell.get("curve") or {}).get("points", []):
            for unit, q in p["vmm"].items():
                values = (label, p["kernel_ratio"], p["best_paged"], unit, q["ratio"], *q["ci95"])
                rows.append(dict(zip(CURVE_KEYS, map(finite, values))))
    return rows


def settings_json(s: StudySettings) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d["cells"] = [{**dataclasses.asdict(c), "label": c.label} for c in s.cells]
    return d


def write_csv(path: Path, keys: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def save(s: StudySettings, result: dict[str, Any], text: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.txt").write_text(text + "\n")
    doc = {"settings": settings_json(s), **result}
    (out / "study.json").write_text(json.dumps(doc, indent=1, default=finite).replace("Infinity", '"inf"'))
    write_csv(out / "study.csv", CSV_KEYS, csv_rows(result["cells"]))
    write_csv(out / "curve.csv", CURVE_KEYS, curve_rows(result["cells"]))
    if s.plots and result["cells"]:
        from kvlab.experiments.studies.page_size.plots import plot_curve, plot_units
        plot_units(result["cells"], out / "study.png")
        if any(c.get("curve") for c in result["cells"].values()):
            plot_curve(result["cells"], out / "curve.png")
    return out
