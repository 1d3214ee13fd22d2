"""`kvlab serve`: build the engine, start its thread, run uvicorn; SIGINT/SIGTERM abort in-flight work, free
everything and exit 0."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import torch
import uvicorn
from kvlab.common.engine import Engine
from kvlab.experiments import cli
from kvlab.experiments.serve.app import Server, create_app
from kvlab.experiments.serve.engine_loop import EngineLoop
from kvlab.experiments.serve.prom import ServerMetrics

log = logging.getLogger("kvlab.serve")
DEFAULT_MAX_WAITING = 1024
GRACEFUL_S = 5


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over one backend",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                          "/metrics with one engine stepping in a background thread.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests queued beyond this are answered 429")
    p.add_argument("--served-model-name", help="the model id clients see (default: --model)")
    cli.add_engine_flags(p)
    p.set_defaults(run=run)


class SignalServer(uvicorn.Server):
    """uvicorn, but a signal first aborts in-flight generation (so streams end at once), and the process exits 0
    afterwards instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = loop

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def on_signal(self, sig: int, frame) -> None:
        log.warning("signal %d: aborting in-flight requests and stopping", sig)
        self.engine_loop.stopping.set()
        self.engine_loop.inbox.put(("wake",))
        self.should_exit = True


def run(args: argparse.Namespace) -> int:
    config = cli.engine_config(args)
    if config.threads:                 # as LLM does: 1 torch thread by default, `--threads 0` keeps torch's own
        torch.set_num_threads(config.threads)
    engine = Engine.from_config(config)
    loop = EngineLoop(engine, ServerMetrics(config.backend), args.max_waiting)
    loop.start()
    app = create_app(Server(loop, args.served_model_name or str(config.model), engine.tokenizer))
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(f"kvlab serve: {config.backend} on http://{args.host}:{sock.getsockname()[1]} "
          f"({torch.get_num_threads()} torch thread(s))", flush=True)
    server = SignalServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_S), loop)
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
        sock.close()
    return 0
