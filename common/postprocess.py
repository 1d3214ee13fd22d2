"""The second half of a scheduler step: apply the sampled tokens.

Per item that needed logits: append the token (and stop on a stop token or max_tokens); at parallel sampling's
first token fork the n - 1 children, which share the prompt's KV (cache.fork) or recompute it if the cache
refuses; for beam search, once every live beam has proposed, select the next beams (common/beam.py), free
the pruned ones and fork parents that continue more than once. A parent may be parked (its KV released
after it proposed): it is pruned from the queue, or continues from there, and its children recompute.
A request finishes when all its sequences do.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from kvlab.common.beam import select_beams
from kvlab.common.errors import OutOfKVCache
from kvlab.common.request import Request, Sample, SampleSpec, SchedulerOutput, SchedulerStats
from kvlab.common.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache

log = logging.getLogger("kvlab.scheduler")

RUNNING, WAITING, SWAPPED, FINISHED = (SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED,
                                       SequenceStatus.FINISHED)


class PostprocessMixin:
    """Mixed into Scheduler: uses its state below and its `_new_seq`, `_enter_running`, `_leave_running`."""
    cache: KVCache
    stats: SchedulerStats
    running: list[Sequence]
    waiting: deque[Sequence]
    swapped: deque[Sequence]
    requests: dict[str, Request]
    req_of: dict[int, Request]
    finished: list[Request]
    now: float
    _specs: dict[int, SampleSpec]

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[Sample]], now: float | None = None
               ) -> None:
        """Apply one step's results. `sampled[seq_id]` is a list of (token, logprob) for each item that needs
        logits, or a bare token id (a runner without logits: every requested sample gets it, logprob 0)."""
        if now is not None:
            self.now = now
        stats = self.stats
        for item in out.items:
            seq = item.seq
            if seq.status is not RUNNING:
                continue
            seq.num_computed_tokens = item.context_len
            stats.computed_tokens += item.num_tokens
            if not item.needs_logits:
                continue
            spec = out.specs[seq.seq_id]
            samples = self._samples(sampled, seq, spec)
            req = self.req_of[seq.seq_id]
            if req.beam is not None:
                req.beam.stash[seq.seq_id] = samples
                if req.beam.ready:
                    self._beam_step(req)
            elif spec.num_samples > 1:
                self._fork_samples(req, seq, samples)
            else:
                self._append(req, seq, *samples[0])
        self.running = [s for s in self.running if s.status is RUNNING]

    @staticmethod
    def _samples(sampled: dict, seq: Sequence, spec: SampleSpec) -> list[Sample]:
        value = sampled.get(seq.seq_id)
        if value is None:
            raise RuntimeError(f"the runner returned no sample for sequence {seq.seq_id} (it needed logits)")
        if isinstance(value, int):
            return [(value, 0.0)] * spec.num_samples
        if not value or (not spec.beam and len(value) != spec.num_samples):
            raise RuntimeError(f"the runner returned {len(value)} samples for sequence {seq.seq_id}, "
                               f"{spec.num_samples} were requested")
        return value

    def _append(self, req: Request, seq: Sequence, token: int, logprob: float,
                check_stop: bool = True) -> None:
        seq.append_token(token)
        seq.cumulative_logprob += logprob
        self.stats.output_tokens += 1
        now = self.now
        if seq.first_token_time is None:
            seq.first_token_time = now
            if req.first_token_time is None:
                req.first_token_time = now
        seq.last_token_time = now
        if check_stop:
            reason = self._stop_reason(req, token, seq.num_output_tokens)
            if reason is not None:
                self._finish_seq(req, seq, reason)

    def _fork_samples(self, req: Request, parent: Sequence, samples: list[Sample]) -> None:
        """Parallel sampling: the parent's prompt KV is shared by n - 1 children forked now."""
        req.pending_forks = 0
        for token, logprob in samples[1:]:
            self._spawn(req, parent, token, logprob)
        self._append(req, parent, *samples[0])

    def _stop_reason(self, req: Request, token: int, num_output_tokens: int) -> str | None:
        if token in req.stop_ids:
            return "stop"
        return "length" if num_output_tokens >= req.params.max_tokens else None

    def _spawn(self, req: Request, parent: Sequence, token: int, logprob: float) -> Sequence:
        """A child of `parent` that continues with `token`: it shares the parent's KV (cache.fork), or is
        queued to recompute it if the cache refuses the fork (the reserve baseline when full) or the parent
        holds no resident KV (a parked beam)."""
        child = self._new_seq(req, parent.token_ids[:parent.prompt_len])
        child.token_ids = list(parent.token_ids)
        child.parent_id = parent.seq_id
        child.cumulative_logprob = parent.cumulative_logprob
        child.first_token_time = parent.first_token_time
        child.num_computed_tokens = parent.num_computed_tokens
        reason = self._stop_reason(req, token, child.num_output_tokens + 1)
        if reason is not None:                       # finished at birth: nothing to hold
            self._append(req, child, token, logprob, check_stop=False)
            self._finish_seq(req, child, reason, check_request=False)
            return child
        if parent.status is not RUNNING:
            self._recompute_child(parent, child, "its KV is not resident (a parked beam)")
        else:
            try:
                self.cache.fork(parent, child)
            except OutOfKVCache as exc:
                self._recompute_child(parent, child, f"the {self.cache.name} cache refused it ({exc})")
            else:
                self._enter_running(child, req)
        self._append(req, child, token, logprob, check_stop=False)
        return child

    def _recompute_child(self, parent: Sequence, child: Sequence, why: str) -> None:
        log.info("fork of sequence %d not shared: %s; the child recomputes instead", parent.seq_id, why)
        self.stats.fork_fallbacks += 1
        child.num_computed_tokens = 0
        child.status = WAITING
        self.waiting.appendleft(child)

    def _beam_step(self, req: Request) -> None:
        state = req.beam
        old_live = state.live
        choices = select_beams(state, req.stop_ids.__contains__, req.params.max_tokens)
        by_parent: dict[int, list] = {}
        for c in choices:
            by_parent.setdefault(c.parent.seq_id, []).append(c)
        for parent in old_live:                      # free dead beams first: their slots serve the forks
            if parent.seq_id not in by_parent:
                self._finish_seq(req, parent, "pruned", check_request=False)
        continued: dict[int, Sequence] = {}
        for parent in old_live:                      # fork while parents are unchanged
            for c in by_parent.get(parent.seq_id, [])[1:]:
                continued[id(c)] = self._spawn(req, parent, c.token, c.logprob)
        for parent in old_live:
            mine = by_parent.get(parent.seq_id)
            if mine:
                self._append(req, parent, mine[0].token, mine[0].logprob, check_stop=False)
                continued[id(mine[0])] = parent
        state.live = [continued[id(c)] for c in choices]
        if req.first_token_time is None:
            req.first_token_time = self.now
        self._maybe_finish_request(req)

    def _finish_seq(self, req: Request, seq: Sequence, reason: str, check_request: bool = True) -> None:
        self._release(seq, req)
        seq.status = FINISHED
        seq.finish_reason = reason
        self._specs.pop(seq.seq_id, None)
        if check_request:
            self._maybe_finish_request(req)

    def _release(self, seq: Sequence, req: Request) -> None:
        """Free whatever `seq` holds wherever it is (running, swapped, waiting); the caller sets its status
        (a running one stays in `running` until the caller rebuilds that list)."""
        if seq.status is RUNNING:
            self.cache.free(seq)
            self._leave_running(seq, req)
        elif seq.status is SWAPPED:
            self.cache.free(seq)                     # drops the host copy
            self.swapped.remove(seq)
        elif seq.status is WAITING and seq in self.waiting:
            self.waiting.remove(seq)

    def _maybe_finish_request(self, req: Request) -> None:
        if req.pending_forks or (req.beam is not None and req.beam.live):
            return
        if all(s.status is FINISHED for s in req.seqs):
            self._complete(req)

    def _complete(self, req: Request, emit: bool = True) -> None:
        req.finished = True
        req.finished_time = self.now
        del self.requests[req.request_id]
        for s in req.seqs:
            self.req_of.pop(s.seq_id, None)
            self._specs.pop(s.seq_id, None)
        if emit:
            self.finished.append(req)
