"""The sweep's plots (PNG) and one self-contained HTML page: tables plus the plots embedded as base64, nothing
loaded from the network."""
from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

PLOTS = {"ttft": ("p50_ttft_ms", "p99_ttft_ms", "TTFT (ms)"), "tpot": ("p50_tpot_ms", "p99_tpot_ms", "TPOT (ms)")}
TABLE = ("backend", "request_rate", "completed", "failed", "p99_ttft_ms", "p99_tpot_ms", "request_goodput",
         "output_throughput", "max_concurrent_requests", "server_preemptions", "total_kv_wait_s",
         "total_recomputed_tokens", "total_map_unmap_s")


def rate_axis(rows: list[dict[str, Any]]) -> dict[float, float]:
    """Rates -> x positions; inf is drawn one step past the largest finite rate."""
    rates = sorted({r["request_rate"] for r in rows})
    finite = [r for r in rates if not math.isinf(r)]
    return {r: (max(finite, default=1) * 2 if math.isinf(r) else r) for r in rates}


def plot(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = rate_axis(rows)
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    paths = []
    charts = {name: keys for name, keys in PLOTS.items()}
    charts["goodput"] = ("request_goodput", None, "goodput (req/s)")
    for name, (p50, p99, label) in charts.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in backends:
            mine = [r for r in rows if r["backend"] == b]
            xs = [x[r["request_rate"]] for r in mine]
            key = p50 if name != "goodput" or mine[0].get(p50) is not None else "request_throughput"
            ax.plot(xs, [r[key] or 0 for r in mine], marker="o", label=f"{b} {'p50' if p99 else key}")
            if p99:
                ax.plot(xs, [r[p99] for r in mine], marker="x", linestyle="--", label=f"{b} p99")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x.values()), [("inf" if math.isinf(r) else f"{r:g}") for r in x])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, out / f"serve_{name}.png"))
    return paths


def plot_timelines(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Per backend: KV usage (used / total units), KV utilisation (live / allocated tokens) and the running batch
    over each run's time, one line per rate (sampled from the server's /kvlab/stats)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for b in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == b and (r.get("timeline") or {}).get("t")]
        if not mine:
            continue
        fig, (kv, batch) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
        for r in mine:
            tl, rate = r["timeline"], "inf" if math.isinf(r["request_rate"]) else f"{r['request_rate']:g}"
            kv.plot(tl["t"], tl["kv_usage_ratio"], label=f"rate {rate} usage")
            kv.plot(tl["t"], tl["kv_utilization"], linestyle="--", label=f"rate {rate} utilisation")
            batch.plot(tl["t"], tl["running"], label=f"rate {rate}")
        kv.set_ylabel("KV used/total, live/allocated")
        kv.set_ylim(0, 1.05)
        batch.set_ylabel("running sequences")
        batch.set_xlabel("seconds since the run started")
        kv.set_title(f"{b}: KV and running batch over time")
        for ax in (kv, batch):
            ax.legend(fontsize=6)
            ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, out / f"serve_timeline_{b}.png"))
    return paths


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return html.escape("" if v is None else str(v))


def provenance_html(record: dict[str, Any]) -> str:
    """Where the sweep came from: kvlab's commit, the machine, and the resolved configuration as JSON."""
    import json
    kvlab, machine = record["kvlab"], record["machine"]
    facts = (f"kvlab {kvlab['version']} at {kvlab['commit'] or 'no git checkout'}, torch {record['torch']}, "
             f"{machine['cpu']} ({machine['logical_cpus']} CPUs){', ' + machine['gpu'] if machine['gpu'] else ''}")
    config = html.escape(json.dumps(record["config"], indent=1))
    return f"<p>{html.escape(facts)}</p><details><summary>configuration</summary><pre>{config}</pre></details>"


def write_report(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], record: dict[str, Any]) -> Path:
    images = "".join(f'<img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
                     for p in plot(out, rows) + plot_timelines(out, rows))
    head = "".join(f"<th>{k}</th>" for k in TABLE)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(k))}</td>" for k in TABLE) + "</tr>" for r in rows)
    facts = "".join(f"<li>{html.escape(k)}: {cell(v)}</li>" for k, v in meta.items())
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>kvlab serve sweep</title><style>"
            f"body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}"
            f"table{{font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 5px;text-align:right}}"
            f"img{{max-width:48%}}</style></head>"
            f"<body><h1>kvlab serve: paired sweep</h1><ul>{facts}</ul>{provenance_html(record)}"
            f"<table><tr>{head}</tr>{body}</table>"
            f"{images}</body></html>")
    path = out / "report.html"
    path.write_text(page)
    return path
