"""What crosses between the HTTP side and the engine loop, as small typed records: commands in; out, once per loop
turn, an EventBatch of each request's events. In an engine process they are pickled over a socket pair, one
message per step, so each record pickles as its class and field values, about as cheaply as a bare tuple.

A request's events, in order: AcceptedEvent or RejectedEvent; then TokensEvent any number of times; then
FinishedEvent or AbortedEvent once (aborted: by the client, or the server is stopping). A step's TokensEvents cross
as one StepTokens (the step's dicts as the engine returned them: two dicts pickle in C, where one record per
request costs a Python call each); the server side splits it into TokensEvents in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

from kvlab.common.outputs import RequestOutput
from kvlab.common.sampling_params import SamplingParams


def record(cls: type) -> type:
    """A slots dataclass that pickles as (class, field values): no state dict, no __setstate__ call."""
    cls = dataclass(slots=True)(cls)
    names = [f.name for f in fields(cls)]
    get = attrgetter(*names) if names else None
    if len(names) > 1:
        cls.__reduce__ = lambda self: (type(self), get(self))
    else:
        cls.__reduce__ = lambda self: (type(self), (get(self),) if get else ())
    return cls


# -- server -> engine loop ------------------------------------------------------------------------------------
@record
class AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None    # disaggregated serving (Engine.add_request's)


@record
class AbortCommand:
    request_id: str


@record
class StopCommand:
    """Abort everything in flight, close the engine (frees all KV) and end the loop."""


@record
class StatsQuery:
    token: int


Command = AddCommand | AbortCommand | StopCommand | StatsQuery


# -- engine loop -> server: one request's events ------------------------------------------------------------
@record
class AcceptedEvent:
    request_id: str


@record
class RejectedEvent:
    request_id: str
    message: str
    status: int = 400                   # the HTTP status the app answers


@record
class TokensEvent:
    request_id: str
    token_ids: list[list[int]]          # per sample, the tokens new since the last event (engine StepResult)
    logprobs: list[list] | None = None  # per sample, per new token (logprob, top candidates), when asked


@record
class StepTokens:
    """One step's TokensEvents: Engine.step()'s new_tokens and new_logprobs, as they came."""
    new_tokens: dict[str, list[list[int]]]
    new_logprobs: dict[str, list[list]]

    def split(self) -> list[TokensEvent]:
        lps = self.new_logprobs
        return [TokensEvent(rid, new, lps.get(rid)) for rid, new in self.new_tokens.items()]


@record
class FinishedEvent:
    request_id: str
    output: RequestOutput


@record
class AbortedEvent:
    request_id: str


Event = AcceptedEvent | RejectedEvent | TokensEvent | FinishedEvent | AbortedEvent


@record
class EventBatch:
    """One loop turn's events (a step's tokens as one StepTokens), and the scheduler's waiting queue after it (the
    server's admission counts it)."""
    events: list[Event | StepTokens]
    waiting: int


# -- the engine process's own messages --------------------------------------------------------------------------
@record
class ProcessSetup:
    """Sent first: the server's sys.path (set before the EngineConfig is unpickled) and log level."""
    sys_path: list[str]
    log_level: int


@record
class EngineReady:
    tokenizer: Any
    torch_threads: int
    vocab_size: int | None


@record
class EngineFailed:
    error: Exception


@record
class StatsReply:
    token: int
    text: bytes                         # Prometheus text
    stats: dict[str, float]             # /kvlab/stats
