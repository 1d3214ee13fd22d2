"""A sequence: the unit the scheduler moves and the cache stores. One request owns one or more."""
from __future__ import annotations

from enum import Enum, auto

# One output token's log-probability and the top candidates' (token, log-probability), best first.
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()
    FINISHED = auto()


class Sequence:
    """Token ids plus scheduling state. `num_computed_tokens` chases `num_tokens` (vLLM v1 style):
    prefill chunks and decode steps both just compute the next uncomputed tokens."""

    __slots__ = ("seq_id", "request_id", "token_ids", "prompt_len", "max_tokens", "num_computed_tokens",
                 "status", "arrival_time", "admitted_at", "first_token_time", "last_token_time",
                 "token_times", "finish_reason", "cumulative_logprob", "logprobs", "parent_id", "adapter_id")

    def __init__(self, seq_id: int, request_id: str, token_ids: list[int], max_tokens: int,
                 arrival_time: float = 0.0, adapter_id: str = "") -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.prompt_len = len(token_ids)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.arrival_time = arrival_time
        self.admitted_at: int | None = None      # admission order, for newest-first preemption
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[TokenLogprob] = []  # per output token, only when its request asks (params.logprobs)
        self.parent_id: int | None = None
        self.adapter_id = adapter_id            # model/adapter identity, part of prefix hashes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def final_len(self) -> int:
        """The longest this sequence can become (what an oracle reservation holds)."""
        return self.prompt_len + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
