"""PNG plots for bench and simulate (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


@dataclass(slots=True)
class Series:
    """One backend's trace over a run: x (seconds or steps) against a value."""
    label: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    color: str | None = None
    linestyle: str = "-"


def bar_chart(path: str | Path, labels: list[str], values: list[float], ylabel: str, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, labels=[f"{v:,.1f}" for v in values], padding=2)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(0, max(values, default=1) * 1.15 or 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def line_chart(path: str | Path, series: list[Series], xlabel: str, ylabel: str, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, s in enumerate(series):
        ax.plot(s.x, s.y, label=s.label, color=s.color or f"C{i}", linestyle=s.linestyle, linewidth=1.2,
                drawstyle="steps-post")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def downsample(s: Series, max_points: int = 2000) -> Series:
    """Keep every k-th point so long simulated runs make small files."""
    k = max(1, len(s.x) // max_points)
    return Series(s.label, s.x[::k], s.y[::k], s.color, s.linestyle)
