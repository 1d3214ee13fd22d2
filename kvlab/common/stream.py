"""What a step reports, built from the engine's requests: TokenStream keeps what has been reported, so a step
costs its new tokens, never a copy of every output so far; request_output turns a finished request into its
RequestOutput."""
from __future__ import annotations

from collections.abc import Callable

from kvlab.common.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepResult
from kvlab.common.request import Request


class TokenStream:
    """How many output tokens of each sample of each request have been reported."""

    def __init__(self) -> None:
        self.reported: dict[str, list[int]] = {}

    def step(self, sampled: list[Request], finished: list[RequestOutput]) -> StepResult:
        """`sampled`: the requests whose sequences sampled tokens in this step (finished ones included)."""
        result = StepResult(finished=finished)
        for req in sampled:
            if req.beam is None and not req.finished:
                lps = [s.logprobs for s in req.seqs] if req.params.logprobs is not None else None
                self._report(result, req.request_id, [(s.token_ids, s.prompt_len) for s in req.seqs], lps)
        for out in finished:
            lps = [c.logprobs for c in out.outputs] if out.outputs and out.outputs[0].logprobs is not None else None
            self._report(result, out.request_id, [(c.token_ids, 0) for c in out.outputs], lps)
            del self.reported[out.request_id]
        return result

    def _report(self, result: StepResult, request_id: str, samples: list[tuple[list[int], int]],
                logprobs: list[list] | None) -> None:
        """`samples`: each sample's token ids and where its output starts in them; `logprobs`: each sample's per
        output token, or None when the request did not ask."""
        sent = self.reported.setdefault(request_id, [])
        sent += [0] * (len(samples) - len(sent))           # parallel samples fork at the first token
        new = [ids[start + k:] for (ids, start), k in zip(samples, sent)]
        if any(new):
            result.new_tokens[request_id] = new
            if logprobs is not None:
                result.new_logprobs[request_id] = [lps[k:] for lps, k in zip(logprobs, sent)]
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
        asked = req.params.logprobs is not None
        completions = [CompletionOutput(i, s.output_token_ids, decode(s.output_token_ids) if decode else None,
                                        s.finish_reason, s.cumulative_logprob, s.logprobs if asked else None)
                       for i, s in enumerate(req.seqs)]
    att = req.attribution
    metrics = RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time,
                             req.num_preemptions, att.kv_wait_s, att.recomputed_tokens, att.map_unmap_s)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, True, metrics, req.error,
                         error_type=req.error_type)
