"""The engine in a process of its own, as vLLM's engine core: the server process keeps HTTP, tokenizing and
detokenizing, and the engine steps with a GIL of its own, so the HTTP work of one step's tokens overlaps the
next step instead of delaying it (docs/serving.md measures both ways).

The two processes talk over a socket pair, one pickled record (experiments/serve/events.py) per send:
  server -> engine: ProcessSetup (its sys.path and log level), then the EngineConfig (as multiprocessing's spawn
                    does: what the server can import, the engine can unpickle); then AddCommand, AbortCommand,
                    StatsQuery, StopCommand
  engine -> server: EngineReady or EngineFailed once; then an EventBatch once per loop turn with anything to say,
                    and a StatsReply for each StatsQuery, answered between steps

The engine process starts in a session of its own, so a terminal's Ctrl-C (sent to the foreground process group)
never reaches it, not even while its interpreter is still starting (a SIGINT then is a "Fatal Python error:
init_import_site" that no handler can catch); the server orders the stop. It also ignores SIGINT, stops on
("stop",) or SIGTERM, and stops by itself when the pipe closes, so it never outlives the server.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from kvlab.common.errors import KvlabError
from kvlab.experiments.serve.engine_loop import EngineLoop
from kvlab.experiments.serve.engine_start import start_child
from kvlab.experiments.serve.events import (
    Command,
    EngineFailed,
    EngineReady,
    EventBatch,
    ProcessSetup,
    StatsQuery,
    StatsReply,
    StopCommand,
)
from kvlab.experiments.serve.handles import EngineGone, EngineHandle, build_engine

log = logging.getLogger("kvlab.serve")
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 15
QUERY_TIMEOUT_S = 10
EXIT_WAIT_S = 1.0                # a dead engine is reaped within this, to name its exit code or signal
SOCKET_BUFFER = 4 << 20          # a burst of requests fits: a send never blocks the event loop on a busy engine
LOG_FORMAT = "%(name)s: %(levelname)s: %(message)s"       # as the CLI's


class ProcessEngine(EngineHandle):
    """The server's end: starts the engine process and waits until it is ready (its start-up error, if any, is
    raised here); then `attach` reads its messages on the asyncio loop (no extra thread)."""

    def __init__(self, config: Any, max_waiting: int, start_timeout: float = START_TIMEOUT_S) -> None:
        super().__init__(max_waiting, self._send)
        ours, theirs = socket.socketpair()
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        # forked or a new interpreter (engine_start.py); its prints join the server's log, not the start line a
        # caller may parse; a session of its own: the terminal's Ctrl-C is the server's alone (module docstring)
        self.proc = start_child(theirs.fileno(), ours.close, child_main)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.queries: dict[int, asyncio.Future] = {}
        self.query_ids = itertools.count()
        self.alive = self.stopping = False
        self.aloop: asyncio.AbstractEventLoop | None = None
        try:
            self.conn.send(ProcessSetup(sys.path, logging.getLogger().getEffectiveLevel()))
            self.conn.send(config)
            self.tokenizer, self.torch_threads, self.vocab_size = self._wait_ready(start_timeout)
        except BaseException:                                # a bad config, or Ctrl-C while the engine builds
            self.proc.kill()                                  # nothing to save yet; the OS frees its memory
            self.proc.wait()
            self.conn.close()
            raise
        self.alive = True

    def _wait_ready(self, timeout: float) -> tuple[Any, int, int | None]:
        if not self.conn.poll(timeout):
            raise KvlabError(f"the engine process was not ready within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise KvlabError(f"the engine process exited (code {self.proc.wait()}) before it was ready; "
                             "its error is above") from None
        if isinstance(msg, EngineFailed):
            raise msg.error
        return msg.tokenizer, msg.torch_threads, msg.vocab_size

    # -- the asyncio loop's thread -----------------------------------------------------------------------------
    def attach(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.aloop = aloop
        aloop.add_reader(self.conn.fileno(), self._on_readable)

    def is_alive(self) -> bool:
        return self.alive and not self.stopping

    async def snapshot(self) -> tuple[bytes, dict[str, float]]:
        """(Prometheus text, /kvlab/stats dict), read in the engine process after its current step."""
        if not self.alive:
            raise EngineGone("the engine process is not running")
        token = next(self.query_ids)
        self.queries[token] = future = self.aloop.create_future()
        self._send(StatsQuery(token))
        try:
            return await asyncio.wait_for(future, QUERY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineGone(f"the engine process did not answer within {QUERY_TIMEOUT_S} s") from None
        finally:
            self.queries.pop(token, None)

    def _send(self, command: Command) -> None:
        try:
            self.conn.send(command)
        except OSError:
            self._engine_gone()

    def _on_readable(self) -> None:
        try:
            while self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            self._engine_gone()

    def _dispatch(self, msg: EventBatch | StatsReply) -> None:
        if isinstance(msg, EventBatch):
            self.deliver(msg)
            return
        future = self.queries.get(msg.token)
        if future is not None and not future.done():
            future.set_result((msg.text, msg.stats))

    def _engine_gone(self) -> None:
        """The pipe closed: after a stop, or because the engine process died. End every request either way."""
        if self.alive and not self.stopping:
            self.gone_reason = f"the engine process {exit_status(self.proc)}"
            log.error("%s; failing every request", self.gone_reason)
        self.alive = False
        if self.aloop is not None:
            self.aloop.remove_reader(self.conn.fileno())
        self.end_all(self.gone_reason)
        for future in self.queries.values():
            if not future.done():
                future.set_exception(EngineGone("the engine process is not running"))

    # -- stopping ---------------------------------------------------------------------------------------------------
    def begin_stop(self) -> None:
        """From a signal handler: the stop message is sent from the loop, never in the middle of another send."""
        self.stopping = True
        if self.aloop is not None and not self.aloop.is_closed():
            self.aloop.call_soon_threadsafe(self._send, StopCommand())

    async def aclose(self) -> None:
        """Stop the engine while the loop still delivers its last events (aborted streams end cleanly)."""
        self.stopping = True
        if self.alive:
            self._send(StopCommand())
            await asyncio.to_thread(self._wait_exit)
            self._on_readable()                              # the last events, then EOF

    def stop(self) -> None:
        """Make sure the engine process is gone (idempotent; after the loop has ended too)."""
        self.stopping = True
        if self.proc.poll() is None:
            try:
                self.conn.send(StopCommand())
            except OSError:
                pass
            self._wait_exit()
        self.alive = False
        self.conn.close()

    def _wait_exit(self) -> None:
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("the engine process did not stop within %d s; killing it", STOP_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait()


def exit_status(proc: Any) -> str:
    """How a process ended, in words. Its pipe closes a moment before it can be reaped: wait a little for it."""
    try:
        code = proc.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        return "closed its pipe and is still running"
    if code < 0:
        return f"was killed by signal {code_name(-code)}"
    return f"exited with code {code}"


def code_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


# -- the engine process ---------------------------------------------------------------------------------------
class PipeInbox:
    """The engine loop's inbox, read from the pipe. A StatsQuery is answered right here, on the engine's thread,
    between steps; every other command goes to the loop."""

    def __init__(self, conn: Connection, metrics: Any) -> None:
        self.conn, self.metrics = conn, metrics

    def get(self, timeout: float | None = None) -> Command:
        while self.conn.poll(timeout):
            cmd = self.conn.recv()                           # EOFError once the server is gone
            if not isinstance(cmd, StatsQuery):
                return cmd
            send_quietly(self.conn, StatsReply(cmd.token, self.metrics.text(), self.metrics.stats()))
            timeout = 0
        raise queue.Empty

    def get_nowait(self) -> Command:
        return self.get(0)


def child_main(fd: int) -> int:
    conn = Connection(fd)
    setup = conn.recv()
    sys.path[:] = setup.sys_path
    logging.basicConfig(level=setup.log_level, format=LOG_FORMAT)
    config = conn.recv()
    try:
        loop = _build(config, conn)
    except Exception as e:
        if not isinstance(e, KvlabError):
            log.exception("the engine failed to start")
            e = KvlabError(f"the engine failed to start: {type(e).__name__}: {e}")
        try:
            conn.send(EngineFailed(e))
        except Exception:                                    # an exception that does not pickle
            conn.send(EngineFailed(KvlabError(str(e))))
        return 1
    # SIGTERM (alone, or to the whole process group with the server's): stop as a StopCommand would, freeing all
    signal.signal(signal.SIGTERM, lambda sig, frame: loop.stopping.set())
    loop.run()
    return 1 if loop.failed else 0


def _build(config: Any, conn: Connection) -> EngineLoop:
    import torch
    engine, metrics = build_engine(config)
    loop = EngineLoop(engine, metrics, lambda batch: send_quietly(conn, batch), inbox=PipeInbox(conn, metrics))
    conn.send(EngineReady(engine.tokenizer, torch.get_num_threads(), engine.vocab_size))
    return loop


def send_quietly(conn: Connection, msg: EventBatch | StatsReply) -> None:
    try:
        conn.send(msg)
    except OSError:                                          # the server is gone: the next read sees EOF
        pass
