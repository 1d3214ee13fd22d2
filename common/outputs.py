"""What the engine hands back. generate: one RequestOutput per prompt, holding one CompletionOutput per sample or
beam. Engine.step(): a StepResult, each request's new tokens and the requests that finished; TokenStream keeps
what has been reported, so a step costs its new tokens, never a copy of every output so far."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.common.request import Request


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


@dataclass(slots=True)
class StepResult:
    """What one Engine.step() did. `new_tokens[request_id]` holds, per sample, the tokens this step added (only
    requests that got some; a sample with none this step has an empty list). A beam search reports nothing
    until it finishes, then its best beams whole, since beams change until the end. So a request's new tokens,
    joined over its steps, are its final outputs' token_ids; the finishing step's come with its output."""
    new_tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    finished: list[RequestOutput] = field(default_factory=list)


class TokenStream:
    """How many output tokens of each sample of each request have been reported."""

    def __init__(self) -> None:
        self.reported: dict[str, list[int]] = {}

    def step(self, sampled: list[Request], finished: list[RequestOutput]) -> StepResult:
        """`sampled`: the requests whose sequences sampled tokens in this step (finished ones included)."""
        result = StepResult(finished=finished)
        for req in sampled:
            if req.beam is None and not req.finished:
                self._report(result, req.request_id, [(s.token_ids, s.prompt_len) for s in req.seqs])
        for out in finished:
            self._report(result, out.request_id, [(c.token_ids, 0) for c in out.outputs])
            del self.reported[out.request_id]
        return result

    def _report(self, result: StepResult, request_id: str, samples: list[tuple[list[int], int]]) -> None:
        """`samples`: each sample's token ids and where its output starts in them."""
        sent = self.reported.setdefault(request_id, [])
        sent += [0] * (len(samples) - len(sent))           # parallel samples fork at the first token
        new = [ids[start + k:] for (ids, start), k in zip(samples, sent)]
        if any(new):
            result.new_tokens[request_id] = new
            for i, ids in enumerate(new):
                sent[i] += len(ids)

    def forget(self, request_id: str) -> None:
        """An aborted request: nothing more is reported for it."""
        self.reported.pop(request_id, None)


def request_output(req: Request, decode: Callable[[list[int]], str] | None) -> RequestOutput:
    """A finished (or failed) request's output; `decode` turns token ids into text (None: no tokenizer)."""
    if req.beam is not None and req.error is None:
        completions = [CompletionOutput(i, h.token_ids, decode(h.token_ids) if decode else None,
                                        h.finish_reason, h.score)
                       for i, h in enumerate(req.beam.best(req.params.n))]
    elif req.beam is not None:
        completions = [CompletionOutput(0, [], "" if decode else None, "error")]
    else:
        completions = [CompletionOutput(i, s.output_token_ids, decode(s.output_token_ids) if decode else None,
                                        s.finish_reason, s.cumulative_logprob)
                       for i, s in enumerate(req.seqs)]
    att = req.attribution
    metrics = RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time,
                             req.num_preemptions, att.kv_wait_s, att.recomputed_tokens, att.map_unmap_s)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, True, metrics, req.error)
