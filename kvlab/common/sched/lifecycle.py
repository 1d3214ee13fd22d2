"""What happens to sequences and requests once they hold tokens: a sampled token is appended (and stops on a
stop token or max_tokens); a child is spawned sharing its parent's KV (cache.fork) or, if the cache refuses
or the parent holds no resident KV (a parked beam), queued to recompute it; a sequence finishes and frees
what it holds; a request completes when its group allows it and all its sequences finished; a request fails
or is aborted wherever its sequences are. The groups (common/sched/groups.py) decide when to call these."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvlab.common.errors import OutOfKVCache
from kvlab.common.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvlab.common.kv.seam import Allocator
    from kvlab.common.request import Request, SchedulerOutput, SchedulerStats
    from kvlab.common.sched.queues import Queues

log = logging.getLogger("kvlab.scheduler")

RUNNING, WAITING, SWAPPED, FINISHED = (SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED,
                                       SequenceStatus.FINISHED)


class Lifecycle:
    def __init__(self, cache: Allocator, queues: Queues, stats: SchedulerStats) -> None:
        self.cache = cache
        self.queues = queues
        self.stats = stats
        self.now = 0.0                           # the runner's clock at the last update

    # -- tokens and children --------------------------------------------------------------------------------
    def append(self, req: Request, seq: Sequence, token: int, logprob: float, top: tuple = (),
               check_stop: bool = True) -> None:
        """`top`: the row's most likely (token, logprob) pairs, when the request asks for log-probabilities."""
        token_ids, params = seq.token_ids, req.params
        token_ids.append(token)              # Sequence.append_token, inlined: once per token per sequence
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            seq.logprobs.append((logprob, top))
        self.stats.output_tokens += 1
        now = self.now
        if seq.first_token_time is None:
            seq.first_token_time = now
            if req.first_token_time is None:
                req.first_token_time = now
        seq.last_token_time = now
        # stop_reason's test, inlined: it is called only for the token that stops
        if check_stop and (token in req.stop_ids or len(token_ids) - seq.prompt_len >= params.max_tokens):
            self.finish_seq(req, seq, self.stop_reason(req, token, len(token_ids) - seq.prompt_len))

    @staticmethod
    def stop_reason(req: Request, token: int, num_output_tokens: int) -> str | None:
        if token in req.stop_ids:
            return "stop"
        return "length" if num_output_tokens >= req.params.max_tokens else None

    def spawn(self, req: Request, parent: Sequence, token: int, logprob: float, top: tuple = ()) -> Sequence:
        """A child of `parent` that continues with `token`: it shares the parent's KV (cache.fork), or is
        queued to recompute it if the cache refuses the fork (the reserve baseline when full) or the parent
        holds no resident KV (a parked beam)."""
        child = self.queues.new_seq(req, parent.token_ids[:parent.prompt_len])
        child.token_ids = list(parent.token_ids)
        child.parent_id = parent.seq_id
        child.cumulative_logprob = parent.cumulative_logprob
        child.logprobs = list(parent.logprobs)
        child.first_token_time = parent.first_token_time
        child.num_computed_tokens = parent.num_computed_tokens
        reason = self.stop_reason(req, token, child.num_output_tokens + 1)
        if reason is not None:                       # finished at birth: nothing to hold
            self.append(req, child, token, logprob, top, check_stop=False)
            self.finish_seq(req, child, reason, check_request=False)
            return child
        if parent.status is not RUNNING:
            self._recompute_child(parent, child, "its KV is not resident (a parked beam)")
        else:
            try:
                self.cache.fork(parent, child)
            except OutOfKVCache as exc:
                self._recompute_child(parent, child, f"the {self.cache.name} cache refused it ({exc})")
            else:
                self.queues.enter_running(child, req)
        self.append(req, child, token, logprob, top, check_stop=False)
        return child

    def _recompute_child(self, parent: Sequence, child: Sequence, why: str) -> None:
        log.info("fork of sequence %d not shared: %s; the child recomputes instead", parent.seq_id, why)
        self.stats.fork_fallbacks += 1
        child.num_computed_tokens = 0
        child.status = WAITING
        self.queues.waiting.appendleft(child)

    # -- finishing ------------------------------------------------------------------------------------------
    def finish_seq(self, req: Request, seq: Sequence, reason: str, check_request: bool = True) -> None:
        if req.keep_kv and seq.status is RUNNING:      # prefill role: a decode engine pulls the KV later
            self.queues.keep(seq, req)
        else:
            self._release(seq, req)
        seq.status = FINISHED
        seq.finish_reason = reason
        if check_request:
            self.maybe_finish_request(req)

    def _release(self, seq: Sequence, req: Request) -> None:
        """Free whatever `seq` holds wherever it is (running, swapped, waiting); the caller sets its status
        (a running one stays in `running` until the caller prunes that list)."""
        queues = self.queues
        if seq.status is RUNNING:
            self.cache.free(seq)
            queues.leave_running(req)
        elif seq.status is SWAPPED:
            self.cache.free(seq)                     # drops the host copy
            queues.swapped.remove(seq)
        elif seq.status is WAITING and seq in queues.waiting:
            queues.waiting.remove(seq)

    def maybe_finish_request(self, req: Request) -> None:
        if req.group.expects_more():
            return
        if all(s.status is FINISHED for s in req.seqs):
            self._complete(req)

    def fail(self, req: Request, message: str, out: SchedulerOutput | None = None, cause: type | None = None) -> None:
        """`cause`: the type of the exception behind it, for a server to answer with the matching status."""
        log.info("request failed: %s", message)     # reported through the request's output, not twice
        req.error, req.error_type = message, cause
        self.stats.failed_requests += 1
        if out is not None:
            out.failed.append(req.request_id)
        self.drop(req, "error")

    def drop(self, req: Request, reason: str, emit: bool = True) -> None:
        """Release every sequence of `req` wherever it is (running, swapped, waiting)."""
        for seq in req.seqs:
            self._release(seq, req)
            if seq.status is not FINISHED:
                seq.status = FINISHED
                seq.finish_reason = reason
        req.group.drop()
        self.queues.prune_running()
        self.queues.dirty = True
        self._complete(req, emit)

    def _complete(self, req: Request, emit: bool = True) -> None:
        queues = self.queues
        req.finished = True
        req.finished_time = self.now
        del queues.requests[req.request_id]
        for s in req.seqs:
            queues.req_of.pop(s.seq_id, None)
            queues.held.pop(s.seq_id, None)
        req.group = None         # its rules are spent; without the cycle (group.req) refcounting frees the request
        if emit:
            queues.finished.append(req)
