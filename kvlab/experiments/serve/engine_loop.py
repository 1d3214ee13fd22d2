"""The engine loop: the only code that touches the Engine. Commands (experiments/serve/events.py) arrive through
an inbox (a thread-safe queue in a thread, the pipe in an engine process); each step's StepResult becomes the
requests' events (its tokens as one StepTokens), and once per loop turn `send` gets them as one EventBatch, so an
engine process sends one message per step.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvlab.common.errors import KvlabError
from kvlab.experiments.serve.events import (
    AbortCommand,
    AbortedEvent,
    AcceptedEvent,
    AddCommand,
    Event,
    EventBatch,
    FinishedEvent,
    RejectedEvent,
    StepTokens,
    StopCommand,
)

log = logging.getLogger("kvlab.serve")
IDLE_WAIT_S = 0.05


class EngineLoop:
    def __init__(self, engine: Any, metrics: Any, send: Callable[[EventBatch], None], inbox: Any = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.send = send
        self.inbox = inbox if inbox is not None else queue.SimpleQueue()    # get(timeout) / get_nowait()
        self.live: set[str] = set()                   # engine thread only: requests accepted, not yet ended
        self.events: list[Event | StepTokens] = []    # this loop turn's, for the next EventBatch
        self.waiting = 0                               # the scheduler's waiting queue after the last step
        self.stalled = False                           # the last step ran nothing: requests wait for memory
        self.sent_waiting = 0
        self.handoffs = engine.handoff.stats.to_dict()      # the totals last published
        self.stopping = threading.Event()
        self.failed = False
        self.thread = threading.Thread(target=self.run, name="kvlab-engine", daemon=True)

    # -- any thread -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping.is_set()

    def begin_stop(self) -> None:
        """Abort everything in flight soon (streams end at once); safe from a signal handler."""
        self.stopping.set()
        self.inbox.put(StopCommand())

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, close the engine (frees all KV) and join the thread."""
        self.begin_stop()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # -- engine thread (or an engine process's main thread) ------------------------------------------------
    def run(self) -> None:
        try:
            self._publish()                            # GET /kvlab/stats and /metrics complete from the start
            while not self.stopping.is_set():
                idle = self.stalled or not self.engine.has_unfinished()
                self._drain(block=idle)
                if idle:           # the pool's books move while idle too (other engines take what it gave)
                    self.metrics.on_idle(self.engine)
                if self.engine.has_unfinished() and not self.stopping.is_set():
                    self._step()
                else:
                    self._idle()
                self._flush()
        except EOFError:                               # an engine process whose server went away
            log.warning("the server closed the engine's pipe; stopping")
        except KvlabError as e:                        # a known failure (a tensor-parallel rank died): one line
            log.error("engine failed: %s; aborting every request", e)
            self.failed = True
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

    def _handle(self, cmd: AddCommand | AbortCommand | StopCommand) -> None:
        if isinstance(cmd, AddCommand):
            self._add(cmd)
        elif isinstance(cmd, AbortCommand):
            self._abort(cmd.request_id)
        else:
            self.stopping.set()

    def _add(self, cmd: AddCommand) -> None:
        try:
            self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id,
                                    kv_transfer_params=cmd.kv_transfer_params)
        except KvlabError as e:
            self.events.append(RejectedEvent(cmd.request_id, str(e)))
            return
        except Exception as e:                         # a request must not kill the engine thread
            log.exception("add_request failed")
            self.events.append(RejectedEvent(cmd.request_id, f"{type(e).__name__}: {e}"))
            return
        self.live.add(cmd.request_id)
        self.events.append(AcceptedEvent(cmd.request_id))

    def _abort(self, request_id: str) -> None:
        if request_id in self.live:
            self.live.remove(request_id)
            self.engine.abort(request_id)
            self.metrics.on_abort()
            self.events.append(AbortedEvent(request_id))
            self._publish()

    def _step(self) -> None:
        result = self.engine.step()
        if result.new_tokens:
            self.events.append(StepTokens(result.new_tokens, result.new_logprobs))
        now = time.perf_counter()
        for out in result.finished:
            self.live.discard(out.request_id)
            self.events.append(FinishedEvent(out.request_id, out))
            self.metrics.on_finished(out, now)
        self._publish()

    def _idle(self) -> None:
        """Nothing to step: a prefill engine still frees the KV its decode engines took (or let expire), and
        publishes the new totals."""
        self.engine.handoff.poll_idle()
        totals = self.engine.handoff.stats.to_dict()
        if totals != self.handoffs:
            self.handoffs = totals
            self.metrics.on_handoffs(totals)

    def _publish(self) -> None:
        running, waiting, swapped = self.engine.queue_depths()
        self.waiting = waiting
        # a pool's engine waiting for pages (a decode engine waiting for a KV pull waits in step() instead)
        self.stalled = not running and self.engine.has_unfinished() and not self.engine.handoff.pulling()
        self.handoffs = self.engine.handoff.stats.to_dict()
        self.metrics.on_step(self.engine, running, waiting, swapped, force=not self.engine.has_unfinished(),
                             handoffs=self.handoffs)

    def _flush(self) -> None:
        """Send this turn's events, if any, or the waiting count if it changed (the server admits by it)."""
        if self.events or self.waiting != self.sent_waiting:
            batch, self.events, self.sent_waiting = EventBatch(self.events, self.waiting), [], self.waiting
            self.send(batch)

    def _shutdown(self) -> None:
        self.stopping.set()
        for rid in self.live:
            self.engine.abort(rid)
            self.events.append(AbortedEvent(rid))
        self.live.clear()
        while True:                                    # requests that never reached the engine
            try:
                cmd = self.inbox.get_nowait()
            except (queue.Empty, EOFError, OSError):
                break
            if isinstance(cmd, AddCommand):
                self.events.append(RejectedEvent(cmd.request_id, "the server is shutting down", 503))
        self.engine.close()
        self._flush()
