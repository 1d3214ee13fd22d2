"""What the HTTP app needs from an engine, wherever the engine runs, and the simplest place: a thread of the
server process. (engine_process.py runs it in a process of its own, the default for `kvlab serve`.)

The contract, for the app: call everything from the asyncio loop's thread; `attach` once the loop runs; a
request's sink is called on that thread with its events (experiments/serve/events.py), which `deliver`
routes, the one place the engine's events are read on the server side.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.common.errors import KvlabError
from kvlab.experiments.serve.engine_loop import EngineLoop
from kvlab.experiments.serve.events import (
    AbortCommand,
    AbortedEvent,
    AcceptedEvent,
    AddCommand,
    Command,
    Event,
    EventBatch,
    RejectedEvent,
    StepTokens,
    TokensEvent,
)

Sink = Callable[[Event], None]


class EngineGone(KvlabError):
    """The engine is not running (it stopped, or its process died): the app answers 503."""


@dataclass(slots=True)
class Stream:
    """A request sent to the engine and not yet ended: where its events go."""
    sink: Sink
    accepted: bool = False


class EngineHandle:
    """Requests in (`submit`, `abort`), events out (`deliver`). Admission (429 past `max_waiting`) is counted
    here, on the loop's thread: requests sent but not yet accepted or rejected by the engine, plus the engine's
    waiting queue after its last step. `send` takes a command to the engine."""

    tokenizer: Any = None
    vocab_size: int | None = None                   # the model's; /detokenize refuses ids beyond it
    gone_reason = "the server is shutting down"     # what clients are told once the engine is not running

    def __init__(self, max_waiting: int, send: Callable[[Command], None]) -> None:
        self.max_waiting = max_waiting
        self.send = send
        self.pending = 0
        self.last_waiting = 0                          # the engine's waiting queue after its last step
        self.streams: dict[str, Stream] = {}

    def submit(self, request_id: str, prompt: str | list[int], params: Any, sink: Sink,
               kv_transfer_params: dict[str, Any] | None = None) -> bool:
        """False when the waiting queue is full (the caller answers 429)."""
        if self.pending + self.last_waiting >= self.max_waiting:
            return False
        self.pending += 1
        self.streams[request_id] = Stream(sink)
        self.send(AddCommand(request_id, prompt, params, kv_transfer_params))
        return True

    def abort(self, request_id: str) -> None:
        if request_id in self.streams:
            self.send(AbortCommand(request_id))

    def deliver(self, batch: EventBatch) -> None:
        """One loop turn's events -> each request's sink."""
        self.last_waiting = batch.waiting
        streams = self.streams
        for event in batch.events:
            if type(event) is StepTokens:
                for tokens in event.split():
                    stream = streams.get(tokens.request_id)
                    if stream is not None:             # else ended already (the engine was gone)
                        stream.sink(tokens)
                continue
            stream = streams.get(event.request_id)
            if stream is None:
                continue
            if type(event) is not TokensEvent:
                self._settle(stream, event)
            stream.sink(event)

    def _settle(self, stream: Stream, event: Event) -> None:
        if isinstance(event, (AcceptedEvent, RejectedEvent)):
            self.pending -= 1
            stream.accepted = isinstance(event, AcceptedEvent)
        if not isinstance(event, AcceptedEvent):       # rejected, finished or aborted: the request has ended
            del self.streams[event.request_id]

    def end_all(self, message: str) -> None:
        """The engine is gone: every request ends, aborted if the engine had taken it, else rejected (503)."""
        streams, self.streams, self.pending = self.streams, {}, 0
        for rid, stream in streams.items():
            stream.sink(AbortedEvent(rid) if stream.accepted else RejectedEvent(rid, message, 503))


def build_engine(config: Any) -> tuple[Any, Any]:
    """(Engine, ServerMetrics) for `config`, wherever the engine will step. As LLM does, 1 torch thread by
    default; `--threads 0` keeps torch's own count."""
    import torch

    from kvlab.common.engine import Engine
    from kvlab.experiments.serve.prom import ServerMetrics
    if config.threads:
        torch.set_num_threads(config.threads)
    return Engine.from_config(config), ServerMetrics(config.backend)


class ThreadEngine(EngineHandle):
    """The engine steps in a background thread of this process. Simple, but the engine and the HTTP side share
    one GIL, so every streamed token's HTTP work delays the next step (docs/serving.md measures it)."""

    def __init__(self, engine: Any, metrics: Any, max_waiting: int) -> None:
        self.loop = EngineLoop(engine, metrics, self._hop)
        super().__init__(max_waiting, self.loop.inbox.put)
        self.tokenizer, self.vocab_size = engine.tokenizer, engine.vocab_size
        self.aloop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.loop.start()

    def attach(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.aloop = aloop

    def is_alive(self) -> bool:
        return self.loop.is_alive()

    def _hop(self, batch: EventBatch) -> None:
        """Engine thread -> the asyncio loop's thread, once per loop turn."""
        if self.aloop is not None:
            with contextlib.suppress(RuntimeError):           # the event loop is already closed
                self.aloop.call_soon_threadsafe(self.deliver, batch)

    async def snapshot(self) -> tuple[bytes, dict[str, float]]:
        """(Prometheus text, /kvlab/stats dict)."""
        return self.loop.metrics.text(), self.loop.metrics.stats()

    def begin_stop(self) -> None:
        self.loop.begin_stop()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.loop.stop)

    def stop(self) -> None:
        self.loop.stop()
