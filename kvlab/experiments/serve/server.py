"""`kvlab serve`: start the engine (its own process by default, or a thread with --engine-thread), run uvicorn;
SIGINT/SIGTERM abort in-flight work, free everything and exit 0. `--role prefill|decode` serves one side of
disaggregated serving, `--role router` the proxy in front of them (docs/disaggregation.md)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import uvicorn

from kvlab.common.validate import check_int
from kvlab.experiments.cli import flags as cli
from kvlab.experiments.limits import KEEP_ALIVE_S, MAX_HEADER_BYTES, MAX_PORT, MAX_REQUESTS
from kvlab.experiments.pool.guard import readable_books
from kvlab.experiments.serve.app import Server, create_app
from kvlab.experiments.serve.engine_process import ProcessEngine
from kvlab.experiments.serve.handles import EngineHandle, ThreadEngine, build_engine
from kvlab.experiments.serve.router import Router, RouterSettings, create_router_app
from kvlab.experiments.serve.router_server import check_engine_role, router_settings

log = logging.getLogger("kvlab.serve")
GRACEFUL_S = 5
BACKLOG = 2048                 # uvicorn's own


class SignalServer(uvicorn.Server):
    """uvicorn, but a signal first aborts in-flight generation (so streams end at once), and the process exits 0
    afterwards instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, begin_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.begin_stop = begin_stop

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
        self.begin_stop()
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
    if args.role == "router":
        return serve_router(router_settings(args), args.host, args.port)
    check_engine_role(args)
    config = cli.engine_config(vars(args), kv_role=args.role)
    with readable_books(config.kv_pool):
        engine, threads = start_engine(config, args.max_waiting, args.engine_thread)
    try:
        app = create_app(Server(engine, args.served_model_name or str(config.model)))
        sock = bind(args.host, args.port)
        where = "a thread" if args.engine_thread else "its own process"
        role = "" if config.kv_role == "colocated" else f" ({config.kv_role})"
        print(f"kvlab serve: {config.backend}{role} on http://{args.host}:{sock.getsockname()[1]} "
              f"(engine in {where}, {threads} torch thread(s))", flush=True)
        serve(app, sock, engine.begin_stop)
    finally:
        engine.stop()
    return 0


def serve_router(settings: RouterSettings, host: str, port: int) -> int:
    app = create_router_app(Router(settings))
    sock = bind(host, port)
    engines = ", ".join(f"{len(urls)} {role}" for role, urls in settings.engines.items() if urls)
    print(f"kvlab serve: router on http://{host}:{sock.getsockname()[1]} ({engines} engine(s))", flush=True)
    serve(app, sock, lambda: None)
    return 0


def bind(host: str, port: int) -> socket.socket:
    """A listening socket: a client that connects once the start line is printed waits in the backlog until
    uvicorn accepts, instead of being refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def serve(app: object, sock: socket.socket, begin_stop: Callable[[], None]) -> None:
    """uvicorn on a bound socket until a signal (or the app) stops it; the socket is closed after."""
    uv_config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_S,
                               timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    try:
        SignalServer(uv_config, begin_stop).run(sockets=[sock])
    finally:
        sock.close()
