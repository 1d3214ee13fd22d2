"""The engine loop: the only code that touches the Engine. Requests arrive through an inbox (a thread-safe queue
in a thread, the pipe in an engine process); after every step each request's new tokens go back through its
`sink`, and `flush` (if given) runs once per loop turn, so an engine process sends one message per step.

Events a sink receives, in order: ("accepted",) or ("rejected", message[, HTTP status, 400 if absent]); then
("tokens", [new ids per sample]) any number of times; then ("done", RequestOutput | None) once (None: aborted,
or the server is stopping).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.common.errors import KvlabError
from kvlab.common.sampling_params import SamplingParams

log = logging.getLogger("kvlab.serve")
IDLE_WAIT_S = 0.05
Sink = Callable[[tuple], None]


@dataclass(slots=True)
class Live:
    sink: Sink
    sent: list[int] = field(default_factory=list)       # tokens already sent, per sample


class EngineLoop:
    def __init__(self, engine: Any, metrics: Any, inbox: Any = None, flush: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.inbox = inbox if inbox is not None else queue.SimpleQueue()    # get(timeout) / get_nowait()
        self.flush = flush or (lambda: None)
        self.live: dict[str, Live] = {}               # engine thread only
        self.waiting = 0                               # the scheduler's waiting queue after the last step
        self.stopping = threading.Event()
        self.failed = False
        self.thread = threading.Thread(target=self.run, name="kvlab-engine", daemon=True)

    # -- any thread -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping.is_set()

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, sink: Sink) -> None:
        self.inbox.put(("add", request_id, prompt, params, sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def begin_stop(self) -> None:
        """Abort everything in flight soon (streams end at once); safe from a signal handler."""
        self.stopping.set()
        self.inbox.put(("stop",))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, close the engine (frees all KV) and join the thread."""
        self.begin_stop()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # -- engine thread (or an engine process's main thread) ------------------------------------------------
    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished() and not self.stopping.is_set():
                    self._step()
                self.flush()
        except EOFError:                               # an engine process whose server went away
            log.warning("the server closed the engine's pipe; stopping")
        except Exception:                              # a bug in the engine: fail every request, keep no KV
            log.exception("engine loop failed; aborting every request")
            self.failed = True
        finally:
            self._shutdown()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, sink = cmd
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except KvlabError as e:
                sink(("rejected", str(e)))
                return
            except Exception as e:                     # a request must not kill the engine thread
                log.exception("add_request failed")
                sink(("rejected", f"{type(e).__name__}: {e}"))
                return
            self.live[rid] = Live(sink, [0] * params.n)
            sink(("accepted",))
        elif cmd[0] == "stop":
            self.stopping.set()
        elif cmd[0] == "abort":
            live = self.live.pop(cmd[1], None)
            if live is not None:
                self.engine.abort(cmd[1])
                self.metrics.on_abort()
                live.sink(("done", None))
                self._publish()

    def _step(self) -> None:
        finished = self.engine.step()
        for rid, live in self.live.items():
            tokens = self.engine.partial_tokens(rid)
            if tokens is not None:
                self._send_new(live, tokens)
        now = time.perf_counter()
        for out in finished:
            live = self.live.pop(out.request_id, None)
            if live is not None:
                self._send_new(live, [c.token_ids for c in out.outputs])
                live.sink(("done", out))
            self.metrics.on_finished(out, now)
        self._publish()

    def _publish(self) -> None:
        running, waiting, swapped = self.engine.queue_depths()
        self.waiting = waiting                         # one int: read from other threads without a lock
        self.metrics.on_step(self.engine, running, waiting, swapped, force=not self.engine.has_unfinished())

    @staticmethod
    def _send_new(live: Live, tokens: list[list[int]]) -> None:
        new = [t[live.sent[i]:] for i, t in enumerate(tokens)]      # samples fork lazily: maybe fewer than n
        if any(new):
            for i, t in enumerate(tokens):
                live.sent[i] = len(t)
            live.sink(("tokens", new))

    def _shutdown(self) -> None:
        self.stopping.set()
        for rid, live in list(self.live.items()):
            self.engine.abort(rid)
            live.sink(("done", None))
        self.live.clear()
        while True:                                    # requests that never reached the engine
            try:
                cmd = self.inbox.get_nowait()
            except (queue.Empty, EOFError, OSError):
                break
            if cmd[0] == "add":
                cmd[4](("rejected", "the server is shutting down", 503))
        self.engine.close()
        self.flush()
