"""A `kvlab serve` subprocess that cannot hang its caller (experiments/serve/process.py): a server that fails at
start is one ServerNotReady line carrying its log's last line, one that prints nothing is given up at the
deadline, one that ignores SIGTERM is killed, and a real one serves, logs to its file and stops with exit 0."""
from __future__ import annotations

import logging
import subprocess
import sys
import time

import httpx
import pytest

from kvlab.experiments.serve import process
from kvlab.experiments.serve.health import ServerNotReady


def test_a_server_that_fails_at_start_is_one_line_with_its_last_log_line(tmp_path):
    log_file = tmp_path / "bad.log"
    proc = process.launch(["--model", "tiny", "--backend", "no-such-backend"], log_file)
    try:
        with pytest.raises(ServerNotReady) as e:
            process.wait_serving(proc, log_file, time.monotonic() + 120)
    finally:
        process.stop(proc, "bad server", log_file)
    message = str(e.value)
    assert "\n" not in message and "exited with 2" in message and "no-such-backend" in message


def test_a_process_that_prints_nothing_is_given_up_at_the_deadline(tmp_path):
    log_file = tmp_path / "silent.log"
    log_file.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerNotReady, match="printed no start line in time; see .*silent.log"):
            process.wait_serving(proc, log_file, t0 + 0.5)
        assert time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_ignores_sigterm_is_killed_and_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(process, "STOP_TIMEOUT_S", 0.5)
    log_file = tmp_path / "stubborn.log"
    log_file.write_text("still here\n")
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    with caplog.at_level(logging.WARNING, logger="kvlab.serve"):
        process.stop(proc, "stubborn", log_file)
    assert proc.returncode == -9
    assert "ignored SIGTERM" in caplog.text and "exited with -9: still here" in caplog.text


def test_a_real_server_serves_logs_to_its_file_and_stops_with_0(tmp_path):
    log_file = tmp_path / "tiny.log"
    proc = process.launch(["--model", "tiny", "--backend", "vmm"], log_file)
    try:
        url = process.wait_serving(proc, log_file, time.monotonic() + 120)
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        assert url in log_file.read_text()
    finally:
        process.stop(proc, "tiny server", log_file)
    assert proc.returncode == 0
