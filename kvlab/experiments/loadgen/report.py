"""The sweep's plots (PNG) and one self-contained HTML page: tables plus the plots embedded as base64, nothing
loaded from the network."""
from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

PLOTS = {"throughput": ("output_throughput", None, "output throughput (tok/s)"),
         "ttft": ("p50_ttft_ms", "p99_ttft_ms", "TTFT (ms)"), "tpot": ("p50_tpot_ms", "p99_tpot_ms", "TPOT (ms)"),
         "goodput": ("request_goodput", None, "goodput (req/s)")}
TABLE = ("backend", "request_rate", "repeat", "completed", "failed", "p99_ttft_ms", "p99_tpot_ms", "request_goodput",
         "output_throughput", "max_concurrent_requests", "server_preemptions", "total_kv_wait_s",
         "total_recomputed_tokens", "total_map_unmap_s")
CELL_TABLE = ("output_throughput", "request_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms")


def rate_axis(rows: list[dict[str, Any]]) -> dict[float, float]:
    """Rates -> x positions; inf is drawn one step past the largest finite rate."""
    rates = sorted({r["request_rate"] for r in rows})
    finite = [r for r in rates if not math.isinf(r)]
    return {r: (max(finite, default=1) * 2 if math.isinf(r) else r) for r in rates}


def plot(out: Path, cells: list[dict[str, Any]]) -> list[Path]:
    """Per figure, each backend's median over its repeats at each rate, the min-max as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = rate_axis(cells)
    paths = []
    for name, (p50, p99, label) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in dict.fromkeys(c["backend"] for c in cells):
            mine = [c for c in cells if c["backend"] == b]
            if name == "goodput" and mine[0].get(p50) is None:      # no --goodput SLOs: the plain request rate
                p50, label = "request_throughput", "request throughput (req/s)"
            for key, style in ((p50, "-"), (p99, "--")):
                if key is not None:
                    draw(ax, x, [c for c in mine if c.get(key) is not None], key, style,
                         f"{b} {key.split('_')[0] if p99 else 'median'}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x.values()), [("inf" if math.isinf(r) else f"{r:g}") for r in x])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, out / f"serve_{name}.png"))
    return paths


def draw(ax: Any, x: dict[float, float], cells: list[dict[str, Any]], key: str, style: str, label: str) -> None:
    mids = [c[key]["mid"] for c in cells]
    bars = [[m - c[key]["low"] for m, c in zip(mids, cells)], [c[key]["high"] - m for m, c in zip(mids, cells)]]
    ax.errorbar([x[c["request_rate"]] for c in cells], mids, yerr=bars, marker="o", linestyle=style, capsize=3,
                label=label)


def plot_timelines(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Per backend: KV usage (used / total units), KV utilisation (live / allocated tokens) and the running batch
    over each run's time, one line per rate, the first repeat's (sampled from the server's /kvlab/stats)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for b in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == b and (r.get("timeline") or {}).get("t") and not r.get("repeat")]
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


def cells_html(cells: list[dict[str, Any]]) -> str:
    """Each backend at each rate: its runs and median [min-max] per figure; then the verdicts."""
    from kvlab.experiments.loadgen.cells import shown
    head = "".join(f"<th>{k}</th>" for k in ("backend", "request_rate", "runs", *CELL_TABLE))
    body = "".join("<tr>" + "".join(f"<td>{cell(c[k])}</td>" for k in ("backend", "request_rate", "runs"))
                   + "".join(f"<td>{html.escape(shown(c.get(k)))}</td>" for k in CELL_TABLE) + "</tr>" for c in cells)
    verdicts = "".join(f"<li>rate {cell(c['request_rate'])}: {html.escape(v)}</li>"
                       for c in cells for v in c.get("verdicts", []))
    return (f"<h2>Verdicts (against the first backend)</h2><ul>{verdicts or '<li>one backend: none</li>'}</ul>"
            f"<h2>Each backend at each rate: median [min-max] over its repeats</h2>"
            f"<table><tr>{head}</tr>{body}</table>")


def write_report(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], record: dict[str, Any]) -> Path:
    """Verdicts, the spread table and the plots first; each run's row, the facts and the configuration last."""
    from kvlab.experiments.loadgen.cells import cells_of
    cells = cells_of(rows)
    images = "".join(f'<img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
                     for p in plot(out, cells) + plot_timelines(out, rows))
    head = "".join(f"<th>{k}</th>" for k in TABLE)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(k))}</td>" for k in TABLE) + "</tr>" for r in rows)
    facts = "".join(f"<li>{html.escape(k)}: {cell(v)}</li>" for k, v in meta.items())
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>kvlab serve sweep</title><style>"
            f"body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}"
            f"table{{font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 5px;text-align:right}}"
            f"img{{max-width:48%}}</style></head>"
            f"<body><h1>kvlab serve: paired sweep</h1>{cells_html(cells)}<h2>Plots</h2>{images}"
            f"<h2>Every run</h2><table><tr>{head}</tr>{body}</table>"
            f"<h2>Setup</h2><ul>{facts}</ul>{provenance_html(record)}</body></html>")
    path = out / "report.html"
    path.write_text(page)
    return path
