"""One scheduler for every backend: iteration-level (continuous) batching over the KVCache seam.

Each step (vLLM v1 style, `num_computed_tokens` chases `num_tokens`):
1. running sequences, oldest admission first, get their next tokens (a decode token, or the next chunk of a
   prefill/recompute) within the `max_num_batched_tokens` budget; one that cannot grow preempts the most
   recently admitted running sequence (possibly itself) by recompute or swap (`preemption_mode`);
2. if nothing was preempted: swapped sequences come back first (FCFS), then waiting ones are admitted FCFS
   while the cache can hold this step's chunk and still keep the watermark free (only for requests with
   nothing running while something else runs: a lone request is never blocked by it, and a recomputing
   sibling of running work is growth, not admission).
Requests with n > 1 prefill the prompt once and fork n - 1 children (cache.fork) at the first sample; beam
search requests fork and free beams each step (common/beam.py). A beam that is not ready (preempted, or its
fork fell back to recompute) makes its live siblings idle until it catches up; beam groups are preempted
together. Failure policy: invalid requests raise RequestError at add time; a request the cache can never hold
(longer than `cache.max_tokens_per_seq()`, or unable to progress alone) fails alone, finish_reason "error".
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.beam import BeamState, select_beams
from common.errors import OutOfKVCache, RequestError
from common.kv_cache import BatchItem
from common.sampling_params import SamplingParams
from common.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from common.config import EngineConfig
    from common.kv_cache import KVCache

log = logging.getLogger("kvlab.scheduler")

RUNNING, WAITING, SWAPPED, FINISHED = (SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED,
                                       SequenceStatus.FINISHED)
Sample = tuple[int, float]          # (token id, log-probability)


@dataclass(slots=True)
class SampleSpec:
    """How the runner turns one logits row into samples: `num_samples` draws (n at parallel sampling's first
    token), or the top `num_samples` candidates by log-probability (`beam`). `generators` holds one CPU
    torch.Generator per draw for seeded requests (None: the runner's own generator)."""
    params: SamplingParams
    num_samples: int = 1
    generators: list[torch.Generator] | None = None
    beam: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    items: list[BatchItem] = field(default_factory=list)
    specs: dict[int, SampleSpec] = field(default_factory=dict)   # seq_id -> spec, items needing logits
    preempted: list[Sequence] = field(default_factory=list)     # by recompute, this step
    swapped_in: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)             # request ids that failed this step

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    prompt: str | None
    arrival_time: float
    stop_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)      # parallel sampling: index = sample index
    pending_forks: int = 0                                  # children still to fork at the first sample
    beam: BeamState | None = None
    generators: list[torch.Generator] | None = None         # seeded requests: one per sample
    num_running: int = 0
    num_preemptions: int = 0
    num_stalls: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None
    finished: bool = False

    @property
    def width(self) -> int:
        return self.params.width


@dataclass(slots=True)
class SchedulerStats:
    preemptions: int = 0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    recomputed_tokens: int = 0          # tokens computed before a recompute preemption (to be redone)
    swap_ins: int = 0
    fork_fallbacks: int = 0             # forks the cache refused: child recomputes its prompt instead
    stall_preemptions: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    computed_tokens: int = 0


def generator_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF


class Scheduler:
    def __init__(self, config: "EngineConfig", cache: "KVCache", eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.cache = cache
        self.eos = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # admission order: newest last
        self.swapped: deque[Sequence] = deque()
        self.requests: dict[str, Request] = {}     # unfinished
        self.req_of: dict[int, Request] = {}       # seq_id -> request
        self.finished: list[Request] = []          # finished since the last pop_finished()
        self.stats = SchedulerStats()
        self.slots_used = 0                        # sum of widths of requests with a running sequence
        self.watermark_units = int(config.watermark * cache.num_total_units())
        self.now = 0.0
        self._seq_ids = itertools.count()
        self._admissions = itertools.count()
        self._specs: dict[int, SampleSpec] = {}
        self._dirty = False

    # -- requests -------------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float = 0.0, prompt: str | None = None) -> Request:
        """Queue a request. Raises RequestError for what is wrong with the request itself; a request the
        cache cannot hold fails alone (it is returned finished with an error by the next pop_finished)."""
        self._validate(request_id, prompt_token_ids, params)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        req = Request(request_id, params, list(prompt_token_ids), prompt, arrival_time, stop)
        if params.use_beam_search:
            req.beam = BeamState(params.beam_width)
        else:
            req.pending_forks = params.n - 1
        if params.seed is not None:
            req.generators = [torch.Generator().manual_seed(generator_seed(params.seed, i))
                              for i in range(params.n)]
        seq = self._new_seq(req, prompt_token_ids)
        if req.beam:
            req.beam.live.append(seq)
        self.requests[request_id] = req
        self.stats.prompt_tokens += len(prompt_token_ids)
        limit = self.cache.max_tokens_per_seq()
        if seq.final_len > limit:
            self._fail(req, f"request {request_id} needs {seq.final_len} tokens of KV cache but the "
                            f"{self.cache.name} cache holds at most {limit} per sequence "
                            f"(kv_cache_bytes={self.config.kv_cache_bytes}): raise kv_cache_bytes or lower "
                            f"max_tokens")
        else:
            self.waiting.append(seq)
        return req

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        params.validate()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise RequestError(f"request {request_id}: the prompt is empty; give at least one token")
        if len(prompt) + params.max_tokens > self.config.max_model_len:
            raise RequestError(f"request {request_id}: prompt ({len(prompt)} tokens) + max_tokens "
                               f"({params.max_tokens}) exceeds max_model_len ({self.config.max_model_len}); "
                               f"shorten the prompt, lower max_tokens or raise max_model_len")
        if params.width > self.config.max_num_seqs:
            raise RequestError(f"request {request_id}: needs {params.width} sequences at once but "
                               f"max_num_seqs is {self.config.max_num_seqs}")

    def _new_seq(self, req: Request, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), req.request_id, token_ids, req.params.max_tokens,
                       req.arrival_time)
        req.seqs.append(seq)
        self.req_of[seq.seq_id] = req
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request and free everything it holds. False if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._drop(req, "abort", emit=False)       # an aborted request produces no output
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def pop_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done

    # -- schedule -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted and not out.swapped_out:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        if not (out.items or out.preempted or out.swapped_out or out.failed) and self.requests:
            self._break_stall(out)
        if self._dirty:                  # a preemption or failure may have hit an already scheduled item
            self._dirty = False
            out.items = [it for it in out.items if it.seq.status is RUNNING]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running, cache = self.running, self.cache
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if n == 0:                       # a beam waiting for its siblings
                i += 1
                continue
            n = min(n, budget)
            target = seq.num_computed_tokens + n
            if not cache.can_allocate(seq, target):
                i -= self._make_room(seq, target, i, out)
                if seq.status is not RUNNING:
                    continue
            cache.allocate(seq, target)
            self._add_item(out, seq, seq.num_computed_tokens, n)
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, target: int, i: int, out: SchedulerOutput) -> int:
        """Preempt newest-first until `seq` can grow to `target` or is itself preempted. Returns how many
        removed sequences sat before index i (already handled this step)."""
        removed_before = 0
        req = self.req_of[seq.seq_id]
        while not self.cache.can_allocate(seq, target):
            group = self._group(self.running[-1])
            if seq in group and len(group) == len(self.running):
                removed_before += sum(1 for s in group if self.running.index(s) < i)
                self._fail(req, f"request {req.request_id} cannot grow to {target} tokens even alone in the "
                                f"{self.cache.name} cache: raise kv_cache_bytes or lower max_tokens", out)
                return removed_before
            removed_before += sum(1 for s in group if self.running.index(s) < i)
            self._preempt_group(group, out)
            if seq.status is not RUNNING:
                break
        return removed_before

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        cache = self.cache
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            req = self.req_of[seq.seq_id]
            if not self._has_slots(req):
                break
            if not cache.can_swap_in(seq, self._watermark(req)):
                break
            cache.swap_in(seq)
            self.swapped.popleft()
            self._enter_running(seq, req)
            out.swapped_in.append(seq)
            self.stats.swap_ins += 1
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 0 and cache.can_allocate(seq, seq.num_computed_tokens + n):
                cache.allocate(seq, seq.num_computed_tokens + n)
                self._add_item(out, seq, seq.num_computed_tokens, n)
                budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cache = self.cache
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            req = self.req_of[seq.seq_id]
            if not self._has_slots(req):
                break
            target = seq.num_computed_tokens + min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not cache.can_allocate(seq, target, self._watermark(req)):
                break
            hit = cache.allocate(seq, target)
            self.waiting.popleft()
            self._enter_running(seq, req)
            if hit:
                seq.num_computed_tokens = max(seq.num_computed_tokens, min(hit, seq.num_tokens - 1))
            start = seq.num_computed_tokens
            if target <= start:              # the prefix hit covered this chunk: take the next one
                target = start + min(seq.num_tokens - start, budget)
                if not cache.can_allocate(seq, target):
                    continue
                cache.allocate(seq, target)
            self._add_item(out, seq, start, target - start)
            budget -= target - start

    def _add_item(self, out: SchedulerOutput, seq: Sequence, start: int, n: int) -> None:
        logits = start + n == seq.num_tokens
        out.items.append(BatchItem(seq, start, n, logits))
        if logits:
            out.specs[seq.seq_id] = self._spec(seq)

    def _spec(self, seq: Sequence) -> SampleSpec:
        spec = self._specs.get(seq.seq_id)
        if spec is not None:
            return spec
        req = self.req_of[seq.seq_id]
        p = req.params
        if req.beam is not None:
            return SampleSpec(p, 2 * p.beam_width, None, beam=True)
        if req.pending_forks and seq is req.seqs[0]:
            return SampleSpec(p, p.n, req.generators)      # the first sample of every child
        index = req.seqs.index(seq)
        spec = SampleSpec(p, 1, None if req.generators is None else [req.generators[index]])
        self._specs[seq.seq_id] = spec
        return spec

    def _watermark(self, req: Request) -> int:
        """Free units a (re)admission must leave: none when nothing runs (a lone request is never blocked)
        or when the request already runs (a sibling of admitted work grows it, like decode growth)."""
        return self.watermark_units if self.running and req.num_running == 0 else 0

    def _has_slots(self, req: Request) -> bool:
        return req.num_running > 0 or self.slots_used + req.width <= self.config.max_num_seqs

    def _enter_running(self, seq: Sequence, req: Request) -> None:
        seq.status = RUNNING
        seq.admitted_at = next(self._admissions)
        self.running.append(seq)
        if req.num_running == 0:
            self.slots_used += req.width
        req.num_running += 1

    def _leave_running(self, seq: Sequence, req: Request) -> None:
        """Slot accounting only: the caller changes the status and the running list."""
        req.num_running -= 1
        if req.num_running == 0:
            self.slots_used -= req.width

    # -- preemption -----------------------------------------------------------------------------------------
    def _group(self, seq: Sequence) -> list[Sequence]:
        """What must be preempted together: a beam search's running beams; otherwise the sequence alone."""
        req = self.req_of[seq.seq_id]
        if req.beam is None:
            return [seq]
        return [s for s in self.running if self.req_of[s.seq_id] is req]

    def _preempt_group(self, group: list[Sequence], out: SchedulerOutput,
                       force_recompute: bool = False) -> None:
        for seq in reversed(group):              # newest first, so the oldest ends up at the queue front
            if seq is self.running[-1]:
                self.running.pop()
            else:
                self.running.remove(seq)
            self._preempt(seq, out, force_recompute)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, force_recompute: bool) -> None:
        req = self.req_of[seq.seq_id]
        self._leave_running(seq, req)
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self._dirty = True
        if self.config.preemption_mode == "swap" and not force_recompute and seq.num_computed_tokens > 0:
            self.cache.swap_out(seq)
            seq.status = SWAPPED
            self.swapped.appendleft(seq)
            out.swapped_out.append(seq)
            self.stats.swap_preemptions += 1
            return
        self.cache.free(seq)
        self.stats.recompute_preemptions += 1
        self.stats.recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.status = WAITING
        if req.beam is not None:
            req.beam.stash.pop(seq.seq_id, None)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _break_stall(self, out: SchedulerOutput) -> None:
        """Nothing could be scheduled although requests remain: running beams wait for a sibling that does
        not fit, or the queue head cannot fit even in an empty cache."""
        if self.running:
            group = self._group(self.running[-1])
            req = self.req_of[group[0].seq_id]
            if len(group) == len(self.running):
                req.num_stalls += 1
                if req.num_stalls > 1:
                    self._fail(req, f"request {req.request_id} cannot make progress alone in the "
                                    f"{self.cache.name} cache: raise kv_cache_bytes or lower beam_width/n",
                               out)
                    return
            log.info("stall: preempting request %s (%d sequences) so waiting work can run",
                     req.request_id, len(group))
            self.stats.stall_preemptions += 1
            self._preempt_group(group, out, force_recompute=True)
            return
        head = self.swapped[0] if self.swapped else self.waiting[0]
        req = self.req_of[head.seq_id]
        self._fail(req, f"request {req.request_id} does not fit even in an empty {self.cache.name} cache "
                        f"({head.num_tokens} tokens): raise kv_cache_bytes or lower max_tokens", out)

    # -- update ---------------------------------------------------------------------------------------------
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
        queued to recompute it if the cache refuses the fork (the reserve baseline when full)."""
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
        try:
            self.cache.fork(parent, child)
        except OutOfKVCache as exc:
            log.info("fork of sequence %d refused by the %s cache (%s): the child recomputes instead",
                     parent.seq_id, self.cache.name, exc)
            self.stats.fork_fallbacks += 1
            child.num_computed_tokens = 0
            child.status = WAITING
            self.waiting.appendleft(child)
        else:
            self._enter_running(child, req)
        self._append(req, child, token, logprob, check_stop=False)
        return child

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
        req.num_stalls = 0                           # progress: only consecutive stalls count
        if req.first_token_time is None:
            req.first_token_time = self.now
        self._maybe_finish_request(req)

    def _finish_seq(self, req: Request, seq: Sequence, reason: str, check_request: bool = True) -> None:
        if seq.status is RUNNING:
            self.cache.free(seq)
            self._leave_running(seq, req)
        seq.status = FINISHED
        seq.finish_reason = reason
        self._specs.pop(seq.seq_id, None)
        if check_request:
            self._maybe_finish_request(req)

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

    # -- failure and abort ----------------------------------------------------------------------------------
    def _fail(self, req: Request, message: str, out: SchedulerOutput | None = None) -> None:
        log.error("%s", message)
        req.error = message
        self.stats.failed_requests += 1
        if out is not None:
            out.failed.append(req.request_id)
        self._drop(req, "error")

    def _drop(self, req: Request, reason: str, emit: bool = True) -> None:
        """Release every sequence of `req` wherever it is (running, swapped, waiting)."""
        for seq in req.seqs:
            if seq.status is RUNNING:
                self.cache.free(seq)
                self._leave_running(seq, req)
            elif seq.status is SWAPPED:
                self.cache.free(seq)             # drops the host copy
                self.swapped.remove(seq)
            elif seq.status is WAITING and seq in self.waiting:
                self.waiting.remove(seq)
            if seq.status is not FINISHED:
                seq.status = FINISHED
                seq.finish_reason = reason
        if req.beam is not None:
            req.beam.live = []
            req.beam.stash.clear()
        req.pending_forks = 0
        self.running[:] = [s for s in self.running if s.status is RUNNING]   # in place: schedule holds it
        self._dirty = True
        self._complete(req, emit)

    # -- debugging ------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        assert all(s.status is RUNNING for s in self.running)
        assert all(s.status is WAITING for s in self.waiting)
        assert all(s.status is SWAPPED for s in self.swapped)
        assert len(self.running) <= self.config.max_num_seqs, (len(self.running), self.config.max_num_seqs)
        live = {id(r): r for r in (self.req_of[s.seq_id] for s in self.running)}
        assert self.slots_used == sum(r.width for r in live.values()), "slot accounting drifted"
        assert self.slots_used <= self.config.max_num_seqs
        for s in self.running:
            assert self.cache.holds(s), f"running sequence {s.seq_id} holds no KV"
            assert s.num_computed_tokens <= s.num_tokens
        for s in self.waiting:
            assert not self.cache.holds(s), f"waiting sequence {s.seq_id} still holds KV"
