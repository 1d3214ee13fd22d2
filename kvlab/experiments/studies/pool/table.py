"""The A/B's table: per model and configuration, the median over repeats of p99 TTFT, p99 TPOT, SLO attainment,
and the server's preemptions and seconds in map/unmap calls summed over the model's requests, with their range;
and the paired difference against the baseline (a): in each repeat, this configuration's value minus (a)'s,
then the median and range of those differences."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

METRICS = (("p99_ttft_ms", "p99 TTFT ms"), ("p99_tpot_ms", "p99 TPOT ms"), ("slo_attainment", "SLO attained"),
           ("total_num_preemptions", "preemptions"), ("total_map_unmap_s", "map+unmap s"))


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    low: float
    high: float

    def text(self, percent: bool = False, signed: bool = False) -> str:
        """"median [low, high]": percents whole, else one decimal below 100 and none from 100 up."""
        if math.isnan(self.median):
            return "n/a"
        sign = "+" if signed else ""
        decimals = 0 if max(abs(self.low), abs(self.high)) >= 100 else 1
        spec = f"{sign}.0%" if percent else f"{sign},.{decimals}f"
        return f"{self.median:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


def spread(values: list[float]) -> Spread:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite:
        return Spread(math.nan, math.nan, math.nan)
    return Spread(float(np.median(finite)), min(finite), max(finite))


def values(records: list[dict[str, Any]], config: str, model: int, metric: str) -> dict[int, float]:
    """repeat -> the model's value in that repeat of the configuration."""
    return {r["repeat"]: r["models"][model].get(metric) for r in records if r["configuration"] == config}


def rows(records: list[dict[str, Any]], configs: list[str], models: int, baseline: str) -> list[dict[str, Any]]:
    """One row per (model, configuration): each metric's Spread and its paired difference to the baseline."""
    out = []
    for model in range(models):
        for config in configs:
            row: dict[str, Any] = {"model": model, "configuration": config}
            for metric, _ in METRICS:
                mine, base = values(records, config, model, metric), values(records, baseline, model, metric)
                row[metric] = spread(list(mine.values()))
                paired = [mine[r] - base[r] for r in mine if r in base and None not in (mine[r], base[r])]
                row[f"{metric}_vs_{baseline}"] = spread(paired) if config != baseline else None
            out.append(row)
    return out


def markdown(table: list[dict[str, Any]], labels: dict[str, str], baseline: str) -> str:
    head = ["model", "configuration"] + [f"{name} {h}" for _, name in METRICS for h in ("", f"vs ({baseline})")]
    lines = ["| " + " | ".join(h.strip() for h in head) + " |", "|" + "---|" * len(head)]
    for row in table:
        cells = [str(row["model"]), labels[row["configuration"]]]
        for metric, _ in METRICS:
            percent = metric == "slo_attainment"
            diff = row[f"{metric}_vs_{baseline}"]
            cells += [row[metric].text(percent), "" if diff is None else diff.text(percent, signed=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def csv_rows(table: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """The table flattened: every Spread as its median, low and high."""
    flat = []
    for row in table:
        out = {"model": row["model"], "configuration": row["configuration"]}
        for metric, _ in METRICS:
            for key in (metric, f"{metric}_vs_{baseline}"):
                s = row[key]
                out |= {f"{key}_{part}": (getattr(s, part) if s is not None else None)
                        for part in ("median", "low", "high")}
        flat.append(out)
    return flat
