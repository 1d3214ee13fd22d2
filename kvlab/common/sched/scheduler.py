"""One scheduler for every backend: iteration-level (continuous) batching over the Allocator seam.

Each step (vLLM v1 style, `num_computed_tokens` chases `num_tokens`):
1. running sequences, oldest admission first, get their next tokens (a decode token, or the next chunk of a
   prefill/recompute) within the `max_num_batched_tokens` budget; one that cannot grow preempts the most
   recently admitted running sequence (possibly itself) by recompute or swap (`preemption_mode`);
2. if nothing was preempted: swapped sequences come back first (FCFS), then waiting ones are admitted FCFS
   while the cache can hold this step's chunk and still keep the watermark free (only for requests with
   nothing running while something else runs: a lone request is never blocked by it, and a recomputing
   sibling of running work is growth, not admission).
Requests with n > 1 prefill the prompt once and fork n - 1 children (cache.fork) at the first sample; beam
search requests fork and free beams each step (common/sched/beam.py). A beam that has proposed its candidates
is idle until every live sibling has (a sibling preempted, or whose fork fell back to recompute, catches up
first); its candidates depend only on its tokens, so they survive preemption. Progress guarantee: idle
beams' KV is released (newest first) before any working sequence is preempted, and at a stall; a released
idle beam is parked: admission passes it over until its group's next step. Working sequences are preempted
one at a time, newest admitted first (vLLM's rule; a beam's surviving siblings keep their shared KV). So
idle beams never block the work their group waits for, a group needs only one beam resident at a time, and
the oldest working sequence computes every step: it is the victim only alone, and then it fails.
Failure policy: invalid requests raise RequestError at add time; a request the cache can never hold
(longer than `cache.max_tokens_per_seq()`, or a sequence unable to grow alone) fails alone, finish_reason
"error", logged at INFO only: the caller reports it through the request's output.
Parts (common/sched/): queues.Queues (where each sequence is, slot accounting), admission.Admission (step 2),
preemption.Preemption (making room, stalls), lifecycle.Lifecycle (append, fork, finish, fail, abort) and
groups (SingleGroup, ParallelGroup, BeamGroup: each request's sampling, fork, idle and park rules). The data
handed out is in common/request.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.errors import RequestError
from kvlab.common.request import KVImport, Request, Sample, SampleSpec, SchedulerOutput, SchedulerStats
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.sched.admission import Admission
from kvlab.common.sched.groups import make_group
from kvlab.common.sched.lifecycle import Lifecycle
from kvlab.common.sched.preemption import Preemption
from kvlab.common.sched.queues import Queues
from kvlab.common.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.seam import Allocator

RUNNING = SequenceStatus.RUNNING


class Scheduler:
    """Wires the parts; owns request intake (add, abort) and the two halves of a step (schedule, update)."""

    def __init__(self, config: EngineConfig, cache: Allocator, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.cache = cache
        self.eos = frozenset(eos_token_ids)
        self.stats = SchedulerStats()
        self.queues = Queues(config.max_num_seqs)
        self.life = Lifecycle(cache, self.queues, self.stats)
        self.admission = Admission(cache, self.queues, self.stats, config.watermark, self.life)
        self.preemption = Preemption(cache, self.queues, self.life, self.stats, config.preemption_mode)

    # -- read-only views (tests, experiments and the engine read them) -------------------------------------
    @property
    def running(self) -> list[Sequence]:
        return self.queues.running

    @property
    def waiting(self):
        return self.queues.waiting

    @property
    def swapped(self):
        return self.queues.swapped

    @property
    def requests(self) -> dict[str, Request]:
        return self.queues.requests

    @property
    def req_of(self) -> dict[int, Request]:
        return self.queues.req_of

    # -- requests -------------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float = 0.0, prompt: str | None = None, keep_kv: bool = False,
            kv_import: KVImport | None = None) -> Request:
        """Queue a request. Raises RequestError for what is wrong with the request itself; a request the
        cache cannot hold fails alone (it is returned finished with an error by the next pop_finished).
        `keep_kv` (prefill role): its KV stays when it finishes, until release_kept. `kv_import` (decode role):
        it starts with the first token appended and admission imports the prompt's KV."""
        self._validate(request_id, prompt_token_ids, params)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        req = Request(request_id, params, list(prompt_token_ids), prompt, arrival_time, stop, keep_kv=keep_kv,
                      kv_import=kv_import)
        req.group = make_group(req, self.life)
        seq = self.queues.new_seq(req, prompt_token_ids)
        if req.beam:
            req.beam.live.append(seq)
        self.queues.requests[request_id] = req
        self.stats.prompt_tokens += len(prompt_token_ids)
        limit = self.cache.max_tokens_per_seq()
        if seq.final_len > limit:
            self.life.fail(req, f"request {request_id} needs {seq.final_len} tokens of KV cache but the "
                                f"{self.cache.name} cache holds at most {limit} per sequence "
                                f"(kv_cache_bytes={self.config.kv_cache_bytes}): "
                                f"{self._fix(limit, len(prompt_token_ids))}")
        elif kv_import is not None:
            self._start_imported(req, seq, kv_import, arrival_time)
        else:
            self.queues.waiting.append(seq)
        return req

    def _start_imported(self, req: Request, seq: Sequence, kv_import: KVImport, now: float) -> None:
        """The first token came with the request (and its logprob, computed by the prefill engine); it waits for
        admission unless that token ended it."""
        self.life.append(req, seq, kv_import.first_token, kv_import.first_logprob, kv_import.first_top)
        req.first_token_time = seq.first_token_time = seq.last_token_time = now
        if not seq.is_finished:
            self.queues.waiting.append(seq)

    def _fix(self, limit: int, prompt_len: int) -> str:
        """The advice that can help: fewer output tokens only if the prompt itself fits."""
        if limit > prompt_len:
            return "raise kv_cache_bytes or lower max_tokens"
        if limit == 0:    # no sequence fits at all (e.g. a per-sequence reservation larger than the budget)
            return "raise kv_cache_bytes or lower max_model_len"
        return "raise kv_cache_bytes"

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        params.validate()
        if request_id in self.queues.requests:
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

    def abort(self, request_id: str) -> bool:
        """Drop a request and free everything it holds. False if it is unknown or already finished."""
        req = self.queues.requests.get(request_id)
        if req is None:
            return False
        self.life.drop(req, "abort", emit=False)    # an aborted request produces no output
        return True

    def has_unfinished(self) -> bool:
        return bool(self.queues.requests)

    def has_finished(self) -> bool:
        """Finished requests not yet collected by pop_finished()."""
        return bool(self.queues.finished)

    def pop_finished(self) -> list[Request]:
        return self.queues.pop_finished()

    def is_kept(self, seq: Sequence) -> bool:
        """Whether a finished sequence's KV is kept for a handoff."""
        return seq.seq_id in self.queues.kept

    def release_kept(self, seq: Sequence) -> None:
        """A kept sequence's KV was freed (its handoff ended): its slot is free again."""
        self.queues.release_kept(seq)

    # -- schedule -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        queues = self.queues
        self.cache.begin_step()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted and not out.swapped_out:
            budget = self.admission.swap_in(out, budget)
            if not queues.swapped:
                self.admission.admit(out, budget)
        idle = not (out.items or out.preempted or out.swapped_out or out.failed or out.pulling)
        if idle and queues.requests and not queues.kept:
            self.preemption.break_stall(out)     # kept KV (prefill role) is released by its pull or its timeout
        if queues.dirty:                 # a preemption or failure may have hit an already scheduled item
            queues.dirty = False
            out.items = [it for it in out.items if it.seq.status is RUNNING]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences, oldest admission first, get their next tokens; one that cannot grow makes room. The
        cache takes the allocations in runs (allocate_each: one call a step unless a sequence finds no room)."""
        running = self.queues.running
        i = 0
        while i < len(running) and budget > 0:
            seqs, sizes, targets, places, end = self._next_tokens(i, budget)
            done = self.cache.allocate_each(seqs, targets)
            budget = self._add_items(out, seqs[:done], sizes, budget)
            if done == len(seqs):
                i = end
                continue
            seq, n, i = seqs[done], sizes[done], places[done]      # no room for it: make room, one at a time
            i -= self.preemption.make_room(seq, targets[done], i, out)
            if seq.status is RUNNING:
                budget = self._add_items(out, [seq], [n], budget)
                i += 1
        return budget

    def _next_tokens(self, i: int, budget: int
                     ) -> tuple[list[Sequence], list[int], list[int], list[int], int]:
        """From running[i] on, within `budget`: the sequences with tokens to compute, how many each (a decode token,
        or a prefill or recompute chunk), the token count each must then hold, their places in the running list,
        and where the list was left."""
        running = self.queues.running
        seqs, sizes, targets, places = [], [], [], []
        while i < len(running) and budget > 0:       # once per running sequence per step: kept flat
            seq = running[i]
            start = seq.num_computed_tokens
            n = len(seq.token_ids) - start
            if n:                                    # 0: a beam waiting for its siblings
                if n > budget:
                    n = budget
                seqs.append(seq)
                sizes.append(n)
                targets.append(start + n)
                places.append(i)
                budget -= n
            i += 1
        return seqs, sizes, targets, places, i

    def _add_items(self, out: SchedulerOutput, seqs: list[Sequence], sizes: list[int], budget: int) -> int:
        """Schedule each sequence's next `size` tokens (group.add_item, inlined: once per sequence per step)."""
        items, specs, req_of = out.items, out.specs, self.queues.req_of
        for seq, n in zip(seqs, sizes):
            start = seq.num_computed_tokens
            logits = start + n == len(seq.token_ids)
            items.append(BatchItem(seq, start, n, logits))
            if logits:
                specs[seq.seq_id] = req_of[seq.seq_id].group.spec(seq)
            budget -= n
        return budget

    # -- update ---------------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[Sample]], now: float | None = None
               ) -> None:
        """Apply one step's results. `sampled[seq_id]` is a list of (token, logprob) for each item that needs
        logits, or a bare token id (a runner without logits: every requested sample gets it, logprob 0)."""
        if now is not None:
            self.life.now = now
        computed, specs, req_of = 0, out.specs, self.queues.req_of
        for item in out.items:
            seq = item.seq
            if seq.status is not RUNNING:
                continue
            seq.num_computed_tokens = item.start + item.num_tokens
            computed += item.num_tokens
            if not item.needs_logits:
                continue
            spec, value, group = specs[seq.seq_id], sampled.get(seq.seq_id), req_of[seq.seq_id].group
            if type(value) is int:        # a runner without logits: the token for every sample, logprob 0
                group.on_token(seq, value, spec)
            else:
                group.on_samples(seq, _samples(value, seq, spec), spec)
        self.stats.computed_tokens += computed
        self.queues.prune_running()

    def check_invariants(self) -> None:
        self.queues.check_invariants(self.cache)


def _samples(value: list[Sample] | None, seq: Sequence, spec: SampleSpec) -> list[Sample]:
    if value is None:
        raise RuntimeError(f"the runner returned no sample for sequence {seq.seq_id} (it needed logits)")
    if not value or (not spec.beam and len(value) != spec.num_samples):
        raise RuntimeError(f"the runner returned {len(value)} samples for sequence {seq.seq_id}, "
                           f"{spec.num_samples} were requested")
    return value
