"""What the engine hands back. generate: one RequestOutput per prompt, holding one CompletionOutput per sample or
beam. Engine.step(): a StepResult, each request's new tokens and the requests that finished (built by
common/stream.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    index: int                          # sample index (n > 1) or beam rank (beam search, best first)
    token_ids: list[int]
    text: str | None                    # None when the model has no tokenizer
    finish_reason: str | None           # "stop" | "length" | "abort" | "error"
    cumulative_logprob: float = 0.0     # sum of the model's log-probabilities of token_ids
    logprobs: list | None = None        # per token (logprob, top candidates), when params.logprobs asked for it

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class RequestMetrics:
    """Times on the runner's clock (wall time for the TorchRunner, simulated for the RooflineRunner)."""
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    kv_wait_s: float = 0.0              # queued with no sequence running: before admission, preempted, swapped out
    recomputed_tokens: int = 0          # computed tokens discarded by recompute preemptions
    map_unmap_s: float = 0.0            # its share of each step's map+unmap seconds (split over running sequences)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None            # set when the request failed alone (finish_reason "error")
    error_type: type | None = None      # the exception type behind `error`, when one was raised (HandoffError...)
    kv_transfer_params: dict[str, Any] | None = None   # prefill role: what a decode engine needs to pull the KV
    handoff: dict[str, Any] | None = None   # prefill/decode roles: seconds, bytes_copied, units_moved, unit

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["error_type"] = None if self.error_type is None else self.error_type.__name__     # JSON-ready
        return d


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its generated tokens and score (cumulative log-probability)."""
    score: float
    token_ids: list[int]
    finish_reason: str


@dataclass(slots=True)
class StepResult:
    """What one Engine.step() did. `new_tokens[request_id]` holds, per sample, the tokens this step added (only
    requests that got some; a sample with none this step has an empty list). A beam search reports nothing
    until it finishes, then its best beams whole, since beams change until the end. So a request's new tokens,
    joined over its steps, are its final outputs' token_ids; the finishing step's come with its output.
    `new_logprobs` has the same shape, one (logprob, top candidates) per new token, for requests asking."""
    new_tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    new_logprobs: dict[str, list[list]] = field(default_factory=dict)
    finished: list[RequestOutput] = field(default_factory=list)
