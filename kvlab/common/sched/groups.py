"""Sequence groups: a request's sampling, fork, idle and park rules, one class per kind.

- SingleGroup: one sequence, one sample per step.
- ParallelGroup (n > 1): the prompt is prefilled once; its first logits row gives n samples, and n - 1
  children fork from it (sharing the prompt's KV, or recomputing it if the cache refuses).
- BeamGroup: every live beam proposes 2*W candidates; a beam that has proposed is idle (running) or parked
  (waiting) until every live sibling has; then common/sched/beam.py selects the next beams, pruned parents
  finish, and parents that continue more than once fork. A parked parent's children recompute.
A group is done expecting sequences when it has no fork pending and no live beam (`expects_more`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.request import SampleSpec, seeded_generators
from kvlab.common.sched.beam import BeamState, select_beams

if TYPE_CHECKING:
    from kvlab.common.request import Request, Sample, SchedulerOutput
    from kvlab.common.sched.lifecycle import Lifecycle
    from kvlab.common.sequence import Sequence


class SingleGroup:
    def __init__(self, req: Request, life: Lifecycle) -> None:
        self.req = req
        self.life = life
        p = req.params
        self.generators = seeded_generators(p.seed, p.n)
        self._spec = SampleSpec(p, 1, None if self.generators is None else [self.generators[0]])

    def spec(self, seq: Sequence) -> SampleSpec:
        """How the runner samples `seq`'s logits row this step."""
        return self._spec

    def on_samples(self, seq: Sequence, samples: list[Sample], spec: SampleSpec) -> None:
        self.life.append(self.req, seq, *samples[0])

    def on_token(self, seq: Sequence, token: int, spec: SampleSpec) -> None:
        """A runner without logits (the simulator's) gave `token`, logprob 0, for every requested sample."""
        self.life.append(self.req, seq, token, 0.0)

    def has_proposed(self, seq: Sequence) -> bool:
        """Idle (running) or parked (waiting) until its siblings catch up: only beams ever are."""
        return False

    def expects_more(self) -> bool:
        """Sequences may still appear (a fork pending, a beam live): the request cannot complete yet."""
        return False

    def drop(self) -> None:
        """The request failed or was aborted: expect nothing more."""


def _token_as_samples(group: SingleGroup, seq: Sequence, token: int, spec: SampleSpec) -> None:
    group.on_samples(seq, [(token, 0.0)] * spec.num_samples, spec)


class ParallelGroup(SingleGroup):
    on_token = _token_as_samples

    def __init__(self, req: Request, life: Lifecycle) -> None:
        super().__init__(req, life)
        self.pending_forks = req.params.n - 1     # children still to fork at the first sample
        self._specs: dict[int, SampleSpec] = {}   # seq_id -> its own sample's spec, after the fork

    def spec(self, seq: Sequence) -> SampleSpec:
        spec = self._specs.get(seq.seq_id)
        if spec is not None:
            return spec
        req = self.req
        if self.pending_forks and seq is req.seqs[0]:
            return SampleSpec(req.params, req.params.n, self.generators)   # the first sample of every child
        index = req.seqs.index(seq)
        spec = SampleSpec(req.params, 1, None if self.generators is None else [self.generators[index]])
        self._specs[seq.seq_id] = spec
        return spec

    def on_samples(self, seq: Sequence, samples: list[Sample], spec: SampleSpec) -> None:
        if spec.num_samples == 1:
            self.life.append(self.req, seq, *samples[0])
            return
        self.pending_forks = 0                    # the parent's prompt KV is shared by n - 1 children
        for sample in samples[1:]:
            self.life.spawn(self.req, seq, *sample)
        self.life.append(self.req, seq, *samples[0])

    def expects_more(self) -> bool:
        return self.pending_forks > 0

    def drop(self) -> None:
        self.pending_forks = 0


class BeamGroup(SingleGroup):
    on_token = _token_as_samples

    def __init__(self, req: Request, life: Lifecycle) -> None:
        super().__init__(req, life)
        req.beam = self.state = BeamState(req.params.beam_width)
        self._spec = SampleSpec(req.params, 2 * req.params.beam_width, None, beam=True)

    def on_samples(self, seq: Sequence, samples: list[Sample], spec: SampleSpec) -> None:
        self.state.stash[seq.seq_id] = samples
        if self.state.ready:
            self._step()

    def has_proposed(self, seq: Sequence) -> bool:
        """Its candidates for the group's next step are in: it computes nothing until that step."""
        return seq.seq_id in self.state.stash

    def expects_more(self) -> bool:
        return bool(self.state.live)

    def drop(self) -> None:
        self.state.live = []
        self.state.stash.clear()

    def _step(self) -> None:
        req, life, state = self.req, self.life, self.state
        old_live = state.live
        choices = select_beams(state, req.stop_ids.__contains__, req.params.max_tokens)
        by_parent: dict[int, list] = {}
        for c in choices:
            by_parent.setdefault(c.parent.seq_id, []).append(c)
        for parent in old_live:                      # free dead beams first: their slots serve the forks
            if parent.seq_id not in by_parent:
                life.finish_seq(req, parent, "pruned", check_request=False)
        continued: dict[int, Sequence] = {}
        for parent in old_live:                      # fork while parents are unchanged
            for c in by_parent.get(parent.seq_id, [])[1:]:
                continued[id(c)] = life.spawn(req, parent, c.token, c.logprob)
        for parent in old_live:
            mine = by_parent.get(parent.seq_id)
            if mine:
                life.append(req, parent, mine[0].token, mine[0].logprob, check_stop=False)
                continued[id(mine[0])] = parent
        state.live = [continued[id(c)] for c in choices]
        if req.first_token_time is None:
            req.first_token_time = life.now
        life.maybe_finish_request(req)


def make_group(req: Request, life: Lifecycle) -> SingleGroup:
    p = req.params
    kind = BeamGroup if p.use_beam_search else ParallelGroup if p.n > 1 else SingleGroup
    return kind(req, life)


def add_item(out: SchedulerOutput, req: Request, seq: Sequence, start: int, n: int) -> None:
    """Schedule tokens [start, start + n) of `seq`; if that reaches its end, its group says how to sample."""
    logits = start + n == len(seq.token_ids)
    out.items.append(BatchItem(seq, start, n, logits))
    if logits:
        out.specs[seq.seq_id] = req.group.spec(seq)
