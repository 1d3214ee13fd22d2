"""Each engine's share of the memory over time, from its sampled /kvlab/stats (sampler.py), and the stacked plot.

A pooled engine's share is its `pool` block's engine_bytes / total_bytes (pages it holds, in use or spare). A
static engine owns 1/N of the memory; its share is the part of that it uses: kv_usage_ratio / N (the server
reports used units, not mapped bytes). Shares are read on one grid, each engine's last sample before a grid
point holding until its next."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GRID_S = 0.2


def engine_share(series: dict[str, list], engines: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample times, share of the whole memory at each)."""
    t = np.asarray(series["t"], dtype=float)
    total = series.get("pool_total_bytes") or []
    if any(v for v in total):
        used = np.asarray([e or 0 for e in series["pool_engine_bytes"]], dtype=float)
        return t, used / np.asarray([v or np.inf for v in total], dtype=float)
    return t, np.asarray([u or 0 for u in series["kv_usage_ratio"]], dtype=float) / engines


def on_grid(t: np.ndarray, values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The last value sampled at or before each grid point (0 before the first sample)."""
    index = np.searchsorted(t, grid, side="right") - 1
    return np.where(index >= 0, values[np.clip(index, 0, None)] if len(values) else 0.0, 0.0)


def share_timeline(samples: list[dict[str, list]], duration_s: float) -> dict[str, Any]:
    """{"t_s": grid, "share": [per engine, on the grid]} from 0 to the last sample (the phases' end at least)."""
    end = max([duration_s, *(s["t"][-1] for s in samples if s["t"])])
    grid = np.arange(0.0, end + GRID_S / 2, GRID_S)
    shares = [on_grid(*engine_share(s, len(samples)), grid) for s in samples]
    return {"t_s": grid.round(3).tolist(), "share": [s.round(4).tolist() for s in shares]}


def plot_shares(path: str | Path, panels: list[tuple[str, dict[str, Any]]], labels: list[str],
                bursts: list[list[tuple[float, float]]]) -> Path:
    """One stacked panel per (title, share_timeline); each model's bursts shaded in its colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, 2.4 * len(panels) + 0.6), sharex=True, squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], panels):
        draw_panel(ax, title, timeline, labels, bursts)
    axes[-1, 0].set_xlabel("seconds since the run started (shaded: each model's bursts)")
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def draw_panel(ax: Any, title: str, timeline: dict[str, Any], labels: list[str],
               bursts: list[list[tuple[float, float]]]) -> None:
    colors = [f"C{i}" for i in range(len(labels))]
    for color, windows in zip(colors, bursts):
        for start, end in windows:
            ax.axvspan(start, end, color=color, alpha=0.12, linewidth=0)
    ax.stackplot(timeline["t_s"], *timeline["share"], labels=labels, colors=colors, alpha=0.85, step="post")
    ax.set_ylim(0, 1.0)
    ax.set_ylabel("share of memory")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
