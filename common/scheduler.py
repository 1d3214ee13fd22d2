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
search requests fork and free beams each step (common/beam.py). A beam that has proposed its candidates is
idle until every live sibling has (a sibling preempted, or whose fork fell back to recompute, catches up
first); its candidates depend only on its tokens, so they survive preemption. Progress guarantee: idle
beams' KV is released (newest first) before any working sequence is preempted, and at a stall; a released
idle beam is parked: admission passes it over until its group's next step. Working sequences are preempted
one at a time, newest admitted first (vLLM's rule; a beam's surviving siblings keep their shared KV). So
idle beams never block the work their group waits for, a group needs only one beam resident at a time, and
the oldest working sequence computes every step: it is the victim only alone, and then it fails.
Failure policy: invalid requests raise RequestError at add time; a request the cache can never hold
(longer than `cache.max_tokens_per_seq()`, or a sequence unable to grow alone) fails alone, finish_reason
"error", logged at INFO only: the caller reports it through the request's output.
`update` (applying the sampled tokens) lives in common/postprocess.py; the data handed out in common/request.py.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING

import torch
from kvlab.common.attention.metadata import BatchItem
from kvlab.common.beam import BeamState
from kvlab.common.errors import RequestError
from kvlab.common.postprocess import PostprocessMixin
from kvlab.common.request import Request, SampleSpec, SchedulerOutput, SchedulerStats, generator_seed
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.seam import Allocator

log = logging.getLogger("kvlab.scheduler")

RUNNING, WAITING, SWAPPED, FINISHED = (SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED,
                                       SequenceStatus.FINISHED)


class Scheduler(PostprocessMixin):
    def __init__(self, config: EngineConfig, cache: Allocator, eos_token_ids: tuple[int, ...] = ()) -> None:
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
            if cache.allocate(seq, target) is None:
                i -= self._make_room(seq, target, i, out)
                if seq.status is not RUNNING:
                    continue
            self._add_item(out, seq, seq.num_computed_tokens, n)
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, target: int, i: int, out: SchedulerOutput) -> int:
        """Release idle beams (newest first), then preempt the newest running sequence until `seq` can grow to
        `target` (allocating it) or is itself preempted; alone, it fails. Returns how many removed sequences sat before index
        i (already handled this step)."""
        removed_before = 0
        while self.cache.allocate(seq, target) is None:
            idle = self._newest_idle_beam()
            victim = idle if idle is not None else self.running[-1]
            if victim is seq and len(self.running) == 1:
                req = self.req_of[seq.seq_id]
                self._fail(req, f"request {req.request_id} cannot grow to {target} tokens even alone in the "
                                f"{self.cache.name} cache: raise kv_cache_bytes or lower max_tokens", out)
                return removed_before
            removed_before += self.running.index(victim) < i
            if idle is not None:
                self._release_idle([idle], out)
            else:
                self._preempt_all([victim], out)
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
            if not cache.swap_in(seq, self._watermark(req)):
                break
            self.swapped.popleft()
            self._enter_running(seq, req)
            out.swapped_in.append(seq)
            self.stats.swap_ins += 1
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 0 and cache.allocate(seq, seq.num_computed_tokens + n) is not None:
                self._add_item(out, seq, seq.num_computed_tokens, n)
                budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cache = self.cache
        while budget > 0:
            seq = self._next_waiting()
            if seq is None:
                break
            req = self.req_of[seq.seq_id]
            if not self._has_slots(req):
                break
            target = seq.num_computed_tokens + min(seq.num_tokens - seq.num_computed_tokens, budget)
            hit = cache.allocate(seq, target, self._watermark(req))
            if hit is None:
                break
            self.waiting.remove(seq)                 # the head, unless parked beams precede it
            self._enter_running(seq, req)
            if hit:
                seq.num_computed_tokens = max(seq.num_computed_tokens, min(hit, seq.num_tokens - 1))
            start = seq.num_computed_tokens
            if target <= start:              # the prefix hit covered this chunk: take the next one
                target = start + min(seq.num_tokens - start, budget)
                if cache.allocate(seq, target) is None:
                    continue
            self._add_item(out, seq, start, target - start)
            budget -= target - start

    def _next_waiting(self) -> Sequence | None:
        """The first waiting sequence that needs KV now: parked beams wait for their group's next step."""
        for seq in self.waiting:
            if not self._has_proposed(seq):
                return seq
        return None

    def _has_proposed(self, seq: Sequence) -> bool:
        """A beam whose candidates for its group's next step are in: it computes nothing until that step."""
        beam = self.req_of[seq.seq_id].beam
        return beam is not None and seq.seq_id in beam.stash

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
    def _newest_idle_beam(self) -> Sequence | None:
        for seq in reversed(self.running):
            if self._has_proposed(seq):
                return seq
        return None

    def _release_idle(self, beams: list[Sequence], out: SchedulerOutput) -> None:
        """Free the KV of idle beams (running, candidates in): they keep their candidates and stay parked in
        the waiting queue until their group's next step, when a continuing beam recomputes its tokens."""
        self.stats.idle_beam_releases += len(beams)
        self._preempt_all(beams, out, force_recompute=True)

    def _running_of_request(self, seq: Sequence) -> list[Sequence]:
        req = self.req_of[seq.seq_id]
        return [s for s in self.running if self.req_of[s.seq_id] is req]

    def _preempt_all(self, seqs: list[Sequence], out: SchedulerOutput, force_recompute: bool = False) -> None:
        """Preempt `seqs` (in running order)."""
        for seq in reversed(seqs):               # newest first, so the oldest ends up at the queue front
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
        seq.status = WAITING                     # a beam's candidates stay: they depend only on its tokens
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _break_stall(self, out: SchedulerOutput) -> None:
        """Nothing could be scheduled although requests remain. Either every running sequence is an idle beam
        whose siblings do not fit: release the newest group's idle beams (parked, they do not come back
        before their group's next step, so each stall frees KV for other work); or nothing runs and the
        queue head cannot fit even in an empty cache: it fails alone."""
        if self.running:
            beams = self._running_of_request(self.running[-1])
            log.info("stall: releasing the KV of request %s's %d idle beams so waiting work can run",
                     beams[0].request_id, len(beams))
            self.stats.stall_preemptions += 1
            self._release_idle(beams, out)
            return
        head = self.swapped[0] if self.swapped else self._next_waiting()
        if head is None:
            raise RuntimeError("scheduler stall with nothing running, swapped or admissible: every waiting "
                               "sequence is a parked beam (a group stepped without its last proposal?)")
        req = self.req_of[head.seq_id]
        self._fail(req, f"request {req.request_id} does not fit even in an empty {self.cache.name} cache "
                        f"({head.num_tokens} tokens): raise kv_cache_bytes or lower max_tokens", out)

    # -- failure and abort ----------------------------------------------------------------------------------
    def _fail(self, req: Request, message: str, out: SchedulerOutput | None = None) -> None:
        log.info("request failed: %s", message)     # reported through the request's output, not twice
        req.error = message
        self.stats.failed_requests += 1
        if out is not None:
            out.failed.append(req.request_id)
        self._drop(req, "error")

    def _drop(self, req: Request, reason: str, emit: bool = True) -> None:
        """Release every sequence of `req` wherever it is (running, swapped, waiting)."""
        for seq in req.seqs:
            self._release(seq, req)
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
        for s in self.swapped:
            assert not self.cache.holds(s), f"swapped-out sequence {s.seq_id} still holds resident KV"
