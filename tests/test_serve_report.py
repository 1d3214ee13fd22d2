"""The sweep's HTML report rendered in headless Chromium (Debian's `chromium`): the screenshot must show more
than an empty page. Slow (a browser start); skipped with the reason when chromium is not installed."""
from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

from kvlab.experiments.loadgen.report import write_report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "serve" / "check_report.sh"


def fake_rows() -> list[dict]:
    rows = []
    for b, slow in (("vmm", 1.0), ("paged", 1.3)):
        for rate in (1.0, 4.0, math.inf):
            t = [i * 0.2 for i in range(40)]
            rows.append({"backend": b, "request_rate": rate, "completed": 10, "failed": 0,
                         "p50_ttft_ms": 50 * slow * min(rate, 8), "p99_ttft_ms": 90 * slow * min(rate, 8),
                         "p50_tpot_ms": 10 * slow, "p99_tpot_ms": 20 * slow, "request_goodput": min(rate, 8) / slow,
                         "request_throughput": min(rate, 8), "output_throughput": 100.0, "max_concurrent_requests": 5,
                         "server_preemptions": 2, "total_kv_wait_s": 0.5, "total_recomputed_tokens": 64,
                         "total_map_unmap_s": 0.01,
                         "timeline": {"t": t, "running": [i % 7 for i in range(40)],
                                      "kv_usage_ratio": [min(1, i / 30) for i in range(40)],
                                      "kv_utilization": [0.8] * 40}})
    return rows


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path):
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (apt-get install -y chromium): the report cannot be rendered")
    from kvlab.experiments.reporting.provenance import provenance
    page = write_report(tmp_path, fake_rows(), {"backends": ["vmm", "paged"], "num_prompts": 10},
                        provenance({"command": "bench serve"}))
    assert len(list(tmp_path.glob("serve_*.png"))) == 6      # throughput, ttft, tpot, goodput, 2 timelines
    run = subprocess.run(["bash", str(SCRIPT), str(page), str(tmp_path / "shot.png")], capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-500:]
    assert "ok" in run.stdout


@pytest.mark.slow
def test_check_report_rejects_an_empty_page(tmp_path):
    if not shutil.which("chromium"):
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    page = tmp_path / "report.html"
    page.write_text("<!doctype html><html><body><h1>nothing</h1></body></html>")
    run = subprocess.run(["bash", str(SCRIPT), str(page)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 1 and "empty" in run.stderr
