"""The serving simulator's plots: latency against rate (p50/p99 TTFT and TPOT) per backend, goodput against
rate, the throughput-vs-p99-TTFT Pareto front, and the SLO rate per backend with 95% interval bars."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvlab.experiments.sim.serve.summary import fold


def _figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt, *plt.subplots(figsize=(6.5, 4))


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_vs_rate(out: Path, figures: list[dict[str, Any]], metric: str) -> Path:
    plt, fig, ax = _figure()
    for backend in dict.fromkeys(f["backend"] for f in figures):
        mine = sorted((f for f in figures if f["backend"] == backend and not math.isinf(f["request_rate"])),
                      key=lambda f: f["request_rate"])
        xs = [f["request_rate"] for f in mine]
        for pct, style in (("p50", "-"), ("p99", "--")):
            key = f"{pct}_{metric}_ms"
            ys = [f[key]["mean"] for f in mine]
            err = [f[key]["std"] for f in mine]
            ax.errorbar(xs, ys, yerr=err, linestyle=style, marker="o", capsize=2, label=f"{backend} {pct}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"{metric.upper()} (ms)")
    ax.set_yscale("log")
    return _save(plt, fig, ax, out / f"sim_{metric}_vs_rate.png")


def goodput_vs_rate(out: Path, figures: list[dict[str, Any]]) -> Path:
    plt, fig, ax = _figure()
    for backend in dict.fromkeys(f["backend"] for f in figures):
        mine = sorted((f for f in figures if f["backend"] == backend and not math.isinf(f["request_rate"])),
                      key=lambda f: f["request_rate"])
        key = "request_goodput" if all("request_goodput" in f for f in mine) else "request_throughput"
        ax.errorbar([f["request_rate"] for f in mine], [f[key]["mean"] for f in mine],
                    yerr=[f[key]["std"] for f in mine], marker="o", capsize=2, label=f"{backend} {key}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("req/s")
    return _save(plt, fig, ax, out / "sim_goodput_vs_rate.png")


def pareto(out: Path, rows: list[dict[str, Any]]) -> Path:
    """Each run a point; per backend, the front of runs no other run beats on both throughput and p99 TTFT."""
    plt, fig, ax = _figure()
    for backend in dict.fromkeys(r["backend"] for r in rows):
        pts = sorted((r["p99_ttft_ms"], r["output_throughput"]) for r in rows if r["backend"] == backend)
        front, best = [], -1.0
        for ttft, tput in pts:
            if tput > best:
                front.append((ttft, tput))
                best = tput
        line = ax.plot([p[0] for p in front], [p[1] for p in front], marker="o", label=backend)[0]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, alpha=0.3, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("p99 TTFT (ms)")
    ax.set_ylabel("output throughput (tok/s)")
    return _save(plt, fig, ax, out / "sim_pareto.png")


def slo_bars(out: Path, result: dict[str, Any]) -> Path:
    plt, fig, ax = _figure()
    names = list(result["backends"])
    concurrency = result.get("axis") == "max-concurrency"
    key = "slo_max_concurrency" if concurrency else "slo_rate"
    means = [result["backends"][b][key] for b in names]
    lo = [m - result["backends"][b]["ci95"][0] for b, m in zip(names, means)]
    hi = [result["backends"][b]["ci95"][1] - m for b, m in zip(names, means)]
    ax.bar(names, means, yerr=[lo, hi], capsize=4, label=f"SLO {'max concurrency' if concurrency else 'rate'}, "
                                                          "95% CI")
    ax.set_ylabel("highest max concurrency meeting the SLO" if concurrency else "highest rate meeting the SLO (req/s)")
    return _save(plt, fig, ax, out / "sim_slo_rate.png")


def plot_all(out: Path, rows: list[dict[str, Any]], result: dict[str, Any]) -> list[Path]:
    figures = result.get("figures") or fold(rows)
    paths = [latency_vs_rate(out, figures, "ttft"), latency_vs_rate(out, figures, "tpot"),
             goodput_vs_rate(out, figures), pareto(out, rows)]
    if "backends" in result:
        paths.append(slo_bars(out, result))
    return paths
