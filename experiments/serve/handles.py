"""What the HTTP app needs from an engine, wherever the engine runs, and the simplest place: a thread of the
server process. (engine_process.py runs it in a process of its own, the default for `kvlab serve`.)

The contract, for the app: call everything from the asyncio loop's thread; `attach` once the loop runs; a
request's sink is called on that thread with the events engine_loop.py lists.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvlab.common.errors import KvlabError
from kvlab.experiments.serve.engine_loop import EngineLoop, Sink


class EngineGone(KvlabError):
    """The engine is not running (it stopped, or its process died): the app answers 503."""


class EngineHandle:
    """Admission (429 past `max_waiting`) is counted here, on the loop's thread: requests sent but not yet
    accepted or rejected by the engine, plus the engine's waiting queue after its last step."""

    tokenizer: Any = None

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.pending = 0

    def admit(self, waiting: int) -> bool:
        """`waiting`: the engine's waiting queue after its last step."""
        if self.pending + waiting >= self.max_waiting:
            return False
        self.pending += 1
        return True

    def settle(self, event: tuple) -> None:
        if event[0] in ("accepted", "rejected"):
            self.pending -= 1


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
        super().__init__(max_waiting)
        self.loop = EngineLoop(engine, metrics)
        self.tokenizer = engine.tokenizer
        self.aloop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.loop.start()

    def attach(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.aloop = aloop

    def is_alive(self) -> bool:
        return self.loop.is_alive()

    def submit(self, request_id: str, prompt: str | list[int], params: Any, sink: Sink) -> bool:
        """False when the waiting queue is full (the caller answers 429)."""
        if not self.admit(self.loop.waiting):
            return False
        aloop = self.aloop

        def on_loop(event: tuple) -> None:
            self.settle(event)
            sink(event)

        def hop(event: tuple) -> None:                       # engine thread -> the asyncio loop's thread
            with contextlib.suppress(RuntimeError):           # the event loop is already closed
                aloop.call_soon_threadsafe(on_loop, event)

        self.loop.submit(request_id, prompt, params, hop)
        return True

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def snapshot(self) -> tuple[bytes, dict[str, float]]:
        """(Prometheus text, /kvlab/stats dict)."""
        return self.loop.metrics.text(), self.loop.metrics.stats()

    def begin_stop(self) -> None:
        self.loop.begin_stop()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.loop.stop)

    def stop(self) -> None:
        self.loop.stop()
