"""study.png: SLO rate against tokens per unit, one line per profile and layout (paged solid, vmm dashed, the
optional elastic arm dotted), 95% intervals as bars. curve.png: each vmm unit's SLO rate over the best paged
block's against the paged/contiguous kernel ratio, the 95% band shaded, the tie at 1, the published figures as
vertical marks (docs/evidence.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kvlab.experiments.sim.kernel_evidence import MARKS


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_units(cells: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, cell) in enumerate(cells.items()):
        for layout, style in (("paged", "-o"), ("vmm", "--s"), ("elastic", ":^")):
            units = sorted((u for name, u in cell["units"].items() if name.startswith(layout + "-")),
                           key=lambda u: u["tokens_per_unit"])
            if not units:
                continue
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


def plot_curve(cells: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    line = 0
    for label, cell in cells.items():
        c = cell.get("curve")
        if not c:
            continue
        xs = [p["kernel_ratio"] for p in c["points"]]
        for unit in c["break_even"]:
            q = [p["vmm"][unit] for p in c["points"]]
            color = f"C{line}"
            ax.plot(xs, [v["ratio"] for v in q], "-o", color=color, label=f"{unit}: {label}")
            ax.fill_between(xs, [v["ci95"][0] for v in q], [v["ci95"][1] for v in q], color=color, alpha=0.2)
            line += 1
    ax.axhline(1.0, color="black", linewidth=0.8)
    for i, (name, lo, hi) in enumerate(MARKS):
        style = {"color": "grey", "alpha": 0.25 if hi > lo else 0.8, "linestyle": ":"}
        ax.axvspan(lo, hi, **style) if hi > lo else ax.axvline(lo, **style)
        ax.annotate(name, (hi, 1.0), xytext=(2, 8 + 14 * i), textcoords="offset points", fontsize=6, rotation=0)
    ax.set_xlabel("paged / contiguous decode attention time (16-token blocks, 4,096-token contexts)")
    ax.set_ylabel("vmm SLO rate / best paged SLO rate")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
