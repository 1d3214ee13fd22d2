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
    linestyle: str | None = None     # None: each series its own dash pattern, so identical lines stay visible


# Widest first, each later series thinner and dashed, so a series drawn over an identical one never hides it.
DASHES = ("-", "--", "-.", ":")


def bar_chart(path: str | Path, labels: list[str], values: list[float], ylabel: str, title: str,
              spread: list[tuple[float, float]] | None = None) -> Path:
    """Bars with their value; `spread` (low, high) per bar draws an error bar over the repeats' range."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    errors = None
    if spread:
        errors = [[max(0.0, v - lo) for v, (lo, _) in zip(values, spread)],
                  [max(0.0, hi - v) for v, (_, hi) in zip(values, spread)]]
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))], yerr=errors, capsize=6,
                  error_kw={"elinewidth": 1.2})
    ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:,.1f}" for v in values], padding=2,
                 label_type="center")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    top = max((hi for _, hi in spread), default=0) if spread else 0
    ax.set_ylim(0, max(max(values, default=1), top) * 1.15 or 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def line_chart(path: str | Path, series: list[Series], xlabel: str, ylabel: str, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for i, s in enumerate(series):
        ax.plot(s.x, s.y, label=s.label, color=s.color or f"C{i}", linestyle=s.linestyle or DASHES[i % len(DASHES)],
                linewidth=max(0.8, 2.4 - 0.4 * i), drawstyle="steps-post", alpha=0.9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)   # outside: never on data
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def downsample(s: Series, max_points: int = 2000) -> Series:
    """Keep every k-th point so long simulated runs make small files."""
    k = max(1, len(s.x) // max_points)
    return Series(s.label, s.x[::k], s.y[::k], s.color, s.linestyle)
