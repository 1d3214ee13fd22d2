"""The one "wait until the server is up" helper (experiments/serve/health.py): it returns once /health answers
200, and fails in one ServerNotReady line when the deadline passes or the watched process exits first."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvlab.common.errors import KvlabError
from kvlab.experiments.serve.health import ServerNotReady, healthy, wait_healthy


class LateHealth(BaseHTTPRequestHandler):
    """/health answers 503 until the server's `ready` event is set, then 200."""

    def do_GET(self) -> None:
        ready = self.path == "/health" and self.server.ready.is_set()
        self.send_response(200 if ready else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def late_server() -> Iterator[tuple[str, threading.Event]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), LateHealth)
    server.ready = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.ready
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A port that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def closed_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_server_that_answers_late_is_waited_for(late_server):
    url, ready = late_server
    assert not healthy(url)
    timer = threading.Timer(0.5, ready.set)
    timer.start()
    try:
        wait_healthy(url, 30)
    finally:
        timer.cancel()
    assert ready.is_set() and healthy(url)


@pytest.mark.parametrize("server", ["503", "silent", "closed"])
def test_a_server_that_never_answers_200_fails_in_one_line_at_the_deadline(server, late_server, silent_url):
    url = {"503": late_server[0], "silent": silent_url, "closed": closed_url()}[server]
    started = time.monotonic()
    with pytest.raises(ServerNotReady) as failed:
        wait_healthy(url, 0.6)
    assert 0.6 <= time.monotonic() - started < 0.6 + 2.5        # one probe may still be in flight at the deadline
    assert str(failed.value) == f"{url}/health did not answer 200 within 0.6 s"
    assert isinstance(failed.value, KvlabError)


def test_a_process_that_exits_first_fails_at_once_with_its_exit_code(silent_url):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(30)
    started = time.monotonic()
    with pytest.raises(ServerNotReady) as failed:
        wait_healthy(silent_url, 60, proc)
    assert time.monotonic() - started < 10, "the wait ran on after the process had exited"
    assert str(failed.value) == f"the server at {silent_url} exited with 3 before /health answered 200"


def test_a_running_process_does_not_end_the_wait(late_server):
    url, ready = late_server
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    timer = threading.Timer(0.3, ready.set)
    timer.start()
    try:
        wait_healthy(url, 30, proc)
        assert proc.poll() is None
    finally:
        timer.cancel()
        proc.kill()
        proc.wait(10)
