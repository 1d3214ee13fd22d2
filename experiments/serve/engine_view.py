"""The two reads the server needs that Engine's public API does not offer yet, kept in one place.

Missing hooks (to add to Engine, then delete this module):
- streaming: `step()` returns only finished requests; a server must stream the tokens each step produced, so
  `partial_tokens` reads the live request's sequences. Wanted: `Engine.step()` also returning unfinished
  RequestOutputs (finished=False), as vLLM's does, or `Engine.peek(request_id) -> RequestOutput | None`.
- queue depths: `queue_depths` reads the scheduler's running/waiting/swapped lists. Wanted:
  `Engine.queue_depths() -> (running, waiting, swapped)` (or those counts in `metrics()`).
Both are called only from the engine thread, between steps.
"""
from __future__ import annotations

from typing import Any


def partial_tokens(engine: Any, request_id: str) -> list[list[int]] | None:
    """The output tokens so far, one list per sample; None if the engine no longer holds the request."""
    req = engine.scheduler.requests.get(request_id)
    if req is None or req.beam is not None:
        return None
    return [list(s.output_token_ids) for s in req.seqs]


def queue_depths(engine: Any) -> tuple[int, int, int]:
    s = engine.scheduler
    return len(s.running), len(s.waiting), len(s.swapped)
