"""Ctrl-C during `kvlab simulate serve --jobs 2`: exit 130, one "interrupted" line on stderr (no traceback), and
no worker process left in the command's process group, within seconds."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.processes import children

ROOT = Path(__file__).resolve().parents[1]
BAR = re.compile(r"^simulate serve:\s+\d+%")


def group_alive(pgid: int) -> bool:
    """Any process (not a zombie) left in the process group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_sigint_stops_simulate_serve_and_its_workers(tmp_path):
    err_path = tmp_path / "stderr.txt"
    argv = ["simulate", "serve", "--backends", "paged-16,vmm-2MiB", "--request-rates", "inf", "--num-prompts",
            "200000", "--budget-gb", "6", "--jobs", "2", "--no-save"]
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", *argv], cwd=ROOT, text=True,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        started = time.monotonic()
        while time.monotonic() - started < 60:
            assert proc.poll() is None, f"finished before the interrupt: {err_path.read_text()}"
            if "simulate serve" in err_path.read_text() and len(children(proc.pid)) >= 2 \
                    and time.monotonic() - started > 3:
                break
            time.sleep(0.1)
        workers = children(proc.pid)
        assert len(workers) == 2, "the pool's workers did not start"
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=30)
        assert time.monotonic() - sent < 10, "the interrupt took too long"
        assert proc.returncode == 130, err_path.read_text()
        lines = [ln for ln in err_path.read_text().splitlines() if ln.strip() and not BAR.match(ln.strip())]
        assert lines == ["kvlab simulate: interrupted"], err_path.read_text()
        deadline = time.monotonic() + 15      # 5 s was missed twice on a loaded machine (CI with -n 2, load 17)
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(proc.pid), "a simulate serve worker outlived the interrupted command"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
