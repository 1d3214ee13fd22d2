"""Servers the tests start and talk to: uvicorn with an app in a thread of this process (`serve_in_thread`),
`kvlab serve`'s app over an engine in a thread or a process (`LiveServer`), and `kvlab serve` in a subprocess
(`ServeProcess`, and the prefill/decode/router roles built on it). Each one is stopped within a bound."""
from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.experiments.serve.app import Server, create_app
from kvlab.experiments.serve.engine_process import ProcessEngine
from kvlab.experiments.serve.handles import ThreadEngine
from kvlab.experiments.serve.prom import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"model": "tiny", "backend": "vmm"}
START_S = 120                  # a loaded machine starts the tiny model's server within this
STOP_S = 30


@contextmanager
def serve_in_thread(app):
    """A uvicorn server on a free loopback port, in this process; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def start_engine(kind: str, max_waiting: int, config: dict | None):
    """The engine stepping in a thread of this process, or in a process of its own (as `kvlab serve` runs it)."""
    cfg = make_config(**CONFIG, **(config or {}))
    if kind == "process":
        return ProcessEngine(cfg, max_waiting)
    engine = ThreadEngine(Engine.from_config(cfg), ServerMetrics("vmm"), max_waiting)
    engine.start()
    return engine


class Served:
    """An app (kvlab's, a router, or a stub) served by uvicorn in a thread on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


class LiveServer(Served):
    """kvlab's app over an engine, in a thread on a free 127.0.0.1 port; always stopped (bounded) by the fixture."""

    def __init__(self, max_waiting: int = 1024, config: dict | None = None, engine: str = "thread") -> None:
        self.engine = start_engine(engine, max_waiting, config)
        super().__init__(create_app(Server(self.engine, "tiny")))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.engine.stop()
        self.sock.close()
        assert not self.thread.is_alive()

    def client(self):
        openai = pytest.importorskip("openai")       # a dev dependency (pyproject [dev])
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=60, max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def greedy(max_tokens: int = 8) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


class ServeProcess:
    """`kvlab serve ARGS --port 0` in a session of its own; its URL read from its start line within START_S;
    stopped (SIGTERM to its group, then SIGKILL) by `stop`, always bounded."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", "serve", "--port", "0",
                                      *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        try:
            self.url = self._start_line()
        except BaseException:
            self.stop()
            raise

    def _start_line(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], START_S)
        line = self.proc.stdout.readline() if ready else ""
        found = re.search(r"http://\S+", line)
        if found is None:
            self.stop()
            raise AssertionError(f"no start line within {START_S} s: {line!r}\n{self.proc.stderr.read()[-3000:]}")
        return found.group(0)

    def kill(self) -> None:
        """SIGKILL to the server and its engine process: a crash, as the clients see it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_S)

    def stop(self) -> str:
        """Stop it; its stderr."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.stderr.read()


def engine(backend: str, role: str, *extra: str) -> ServeProcess:
    """A tiny-model server; vmm's prefill and decode engines share a pool named after this test process (the
    pages change owner in its ledger)."""
    pool = ("--kv-pool", f"roles-test-{os.getpid()}", "--kv-pool-bytes", "256MiB")
    shared = pool if backend == "vmm" and role != "colocated" else ()
    return ServeProcess("--model", "tiny", "--backend", backend, "--role", role, "--engine-thread", *shared, *extra)


def router(prefill: list[ServeProcess], decode: list[ServeProcess], *extra: str) -> ServeProcess:
    return ServeProcess("--role", "router", "--prefill", *[p.url for p in prefill],
                        "--decode", *[d.url for d in decode], *extra)
