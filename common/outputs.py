"""What generate returns: one RequestOutput per prompt, holding one CompletionOutput per sample or beam."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    index: int                          # sample index (n > 1) or beam rank (beam search, best first)
    token_ids: list[int]
    text: str | None                    # None when the model has no tokenizer
    finish_reason: str | None           # "stop" | "length" | "abort" | "error"
    cumulative_logprob: float = 0.0     # sum of the model's log-probabilities of token_ids

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its generated tokens and score (cumulative log-probability)."""
    score: float
    token_ids: list[int]
    finish_reason: str
