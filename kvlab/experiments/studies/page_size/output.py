"""study.json (settings, every search, the summaries, flips and verdict), study.csv (one row per cell and unit,
column names with their units), study.png (SLO rate against tokens per unit, one line per profile and layout,
95% intervals as bars) and report.txt, in results/<timestamp>/ or --out."""
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
            "rate_ratio_ci95_high", "break_even_kernel_scale_low_x_profile",
            "break_even_kernel_scale_high_x_profile", "break_even_decode_slowdown_low_x_contiguous",
            "break_even_decode_slowdown_high_x_contiguous",
            "driver_flip_scale_low_x_profile", "driver_flip_scale_high_x_profile")


def finite(x: float | None) -> float | str | None:
    """JSON holds no infinity: an open bracket's end is written "inf"."""
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def csv_rows(cells: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, cell in cells.items():
        for unit, u in cell["units"].items():
            f = cell.get("flips", {}).get(unit, {})
            kernel = f.get("break_even_kernel_scale") or [None, None]
            slowdown = f.get("break_even_decode_slowdown") or [None, None]
            scale = f.get("driver_flip_scale") or [None, None]
            ratio = u["ratio_to_best_paged"]
            values = (label, unit, u["tokens_per_unit"], u["slo_rate"], *u["slo_rate_ci95"], u["output_throughput"],
                      *u["output_throughput_ci95"], ratio["ratio"], *ratio["ci95"], *kernel, *slowdown, *scale)
            rows.append(dict(zip(CSV_KEYS, map(finite, values))))
    return rows


def settings_json(s: StudySettings) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d["cells"] = [{**dataclasses.asdict(c), "label": c.label} for c in s.cells]
    return d


def save(s: StudySettings, result: dict[str, Any], text: str) -> Path:
    from kvlab.experiments.reporting.tables import results_dir
    out = results_dir(s.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.txt").write_text(text + "\n")
    doc = {"settings": settings_json(s), **result}
    (out / "study.json").write_text(json.dumps(doc, indent=1, default=finite).replace("Infinity", '"inf"'))
    with open(out / "study.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS)
        w.writeheader()
        w.writerows(csv_rows(result["cells"]))
    if s.plots:
        plot(result["cells"], out / "study.png")
    return out


def plot(cells: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, cell) in enumerate(cells.items()):
        for layout, style in (("paged", "-o"), ("vmm", "--s")):
            units = sorted((u for name, u in cell["units"].items() if name.startswith(layout + "-")),
                           key=lambda u: u["tokens_per_unit"])
            y = [u["slo_rate"] for u in units]
            err = [[u["slo_rate"] - u["slo_rate_ci95"][0] for u in units],
                   [u["slo_rate_ci95"][1] - u["slo_rate"] for u in units]]
            ax.errorbar([u["tokens_per_unit"] for u in units], y, yerr=err, fmt=style, color=f"C{i}", capsize=3,
                        label=f"{layout}: {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per unit (paged block / vmm page)")
    ax.set_ylabel("highest rate meeting the SLO (req/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

