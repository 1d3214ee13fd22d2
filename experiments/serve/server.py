"""`kvlab serve`: start the engine (its own process by default, or a thread with --engine-thread), run uvicorn;
SIGINT/SIGTERM abort in-flight work, free everything and exit 0."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from typing import Any

import torch
import uvicorn

from kvlab.common.limits import KEEP_ALIVE_S, MAX_HEADER_BYTES, MAX_PORT, MAX_REQUESTS
from kvlab.common.validate import check_int
from kvlab.experiments.cli import flags as cli
from kvlab.experiments.serve.app import Server, create_app
from kvlab.experiments.serve.engine_process import ProcessEngine
from kvlab.experiments.serve.handles import EngineHandle, ThreadEngine, build_engine

log = logging.getLogger("kvlab.serve")
DEFAULT_MAX_WAITING = 1024
GRACEFUL_S = 5


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over one backend",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                          "/metrics with one engine stepping in a process of its own.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests queued beyond this are answered 429")
    p.add_argument("--served-model-name", help="the model id clients see (default: --model)")
    p.add_argument("--engine-thread", action="store_true",
                   help="step the engine in a thread of the server process instead of a process of its own "
                        "(one GIL for both: slower when streaming; see docs/serving.md)")
    p.add_argument("--kv-pool", metavar="NAME", help="vmm: draw KV pages from this machine-wide pool (docs/pool.md)")
    p.add_argument("--kv-pool-bytes", metavar="BYTES", type=cli.parse_bytes,
                   help="create the --kv-pool with this budget if no engine serves it yet, e.g. 8GiB")
    cli.add_engine_flags(p)
    p.set_defaults(run=run)


class SignalServer(uvicorn.Server):
    """uvicorn, but a signal first aborts in-flight generation (so streams end at once), and the process exits 0
    afterwards instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, engine: EngineHandle) -> None:
        super().__init__(config)
        self.engine = engine

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
        self.engine.begin_stop()
        self.should_exit = True


def start_engine(config: Any, max_waiting: int, in_thread: bool) -> tuple[EngineHandle, int]:
    """The engine handle and its torch thread count."""
    if not in_thread:
        engine = ProcessEngine(config, max_waiting)
        return engine, engine.torch_threads
    engine = ThreadEngine(*build_engine(config), max_waiting)
    engine.start()
    return engine, torch.get_num_threads()


def check_server_flags(args: argparse.Namespace) -> None:
    """Before the engine starts: a port socket.bind would refuse with an OverflowError traceback, and a waiting
    queue that would answer every request 429 (or none)."""
    check_int("--port", args.port, 0, MAX_PORT)
    check_int("--max-waiting", args.max_waiting, 1, MAX_REQUESTS, " (queued requests)")


def run(args: argparse.Namespace) -> int:
    check_server_flags(args)
    config = cli.engine_config(vars(args), kv_pool=args.kv_pool, kv_pool_bytes=args.kv_pool_bytes)
    engine, threads = start_engine(config, args.max_waiting, args.engine_thread)
    app = create_app(Server(engine, args.served_model_name or str(config.model)))
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        where = "a thread" if args.engine_thread else "its own process"
        print(f"kvlab serve: {config.backend} on http://{args.host}:{sock.getsockname()[1]} "
              f"(engine in {where}, {threads} torch thread(s))", flush=True)
        uv_config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_S,
                                   timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        SignalServer(uv_config, engine).run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
    return 0
