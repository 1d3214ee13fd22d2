"""What the scheduler tracks and hands out: a request (one sequence group), how to sample its sequences, one
step's output, and the scheduler's counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.sched.beam import BeamState
from kvlab.common.sequence import Sequence

if TYPE_CHECKING:
    import torch

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


class SequenceGroup(Protocol):
    """A request's sampling, fork, idle and park rules; common/sched/groups.py has one class per kind."""

    def spec(self, seq: Sequence) -> SampleSpec:
        """How the runner samples `seq`'s logits row this step."""

    def on_samples(self, seq: Sequence, samples: list[Sample], spec: SampleSpec) -> None: ...

    def on_token(self, seq: Sequence, token: int, spec: SampleSpec) -> None:
        """A runner without logits (the simulator's) gave `token` for every requested sample."""

    def has_proposed(self, seq: Sequence) -> bool:
        """Idle (running) or parked (waiting) until its siblings catch up."""

    def expects_more(self) -> bool:
        """Sequences may still appear (a fork pending, a beam live): the request cannot complete yet."""

    def drop(self) -> None:
        """The request failed or was aborted: expect nothing more."""


# KVImport's answers while the KV is not there yet: admission passes the request over, and keeps back its slot and
# units from the requests behind it only once its pull has started (at most the pull workers' count)
PULLING, PULL_QUEUED = -1, -2


class KVImport(Protocol):
    """A decode request's pending KV import (common/handoff/side.py): its first token (sampled by the prefill
    engine) and the pull that admission calls as its first allocation."""
    first_token: int
    first_logprob: float          # that token's logprob and top candidates, as the prefill engine computed them
    first_top: tuple

    def __call__(self, req: Request, seq: Sequence, reserve_units: int) -> int | None:
        """The tokens of KV now held (the prompt), None if there is no room yet, PULLING while the KV is on its
        way (a worker pulls it) or PULL_QUEUED while its pull waits for a worker: call again at the next admission."""


@dataclass(slots=True)
class SchedulerOutput:
    items: list[BatchItem] = field(default_factory=list)
    specs: dict[int, SampleSpec] = field(default_factory=dict)   # seq_id -> spec, items needing logits
    preempted: list[Sequence] = field(default_factory=list)     # by recompute, this step
    admitted: list[Sequence] = field(default_factory=list)      # waiting -> running, this step
    swapped_in: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)             # request ids that failed this step
    pulling: int = 0                                            # imports passed over: their KV is on its way

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


@dataclass(slots=True)
class KVAttribution:
    """What KV memory cost one request (kept by the engine, on the runner's clock): seconds queued with no
    sequence running (before first admission and while preempted or swapped out), tokens whose KV a recompute
    preemption discarded, and its share of each step's map/unmap seconds (split evenly over the running sequences)."""
    wait_since: float | None = None     # when it last stopped running (or arrived); None while it runs
    kv_wait_s: float = 0.0
    recomputed_tokens: int = 0
    map_unmap_s: float = 0.0


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    prompt: str | None
    arrival_time: float
    stop_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)      # parallel sampling: index = sample index
    beam: BeamState | None = None                           # beam search: live beams, candidates, hypotheses
    group: SequenceGroup | None = None                      # its sampling, fork, idle and park rules
    num_running: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None
    error_type: type | None = None                          # the exception that failed it (a handoff's, say)
    finished: bool = False
    attribution: KVAttribution = field(default_factory=KVAttribution)
    keep_kv: bool = False                                   # prefill role: its KV stays after it finishes
    kv_import: KVImport | None = None                       # decode role: admission pulls its KV first
    handoff: dict[str, Any] | None = None                   # what the pull moved (common/handoff/seam.py)

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
    fork_fallbacks: int = 0             # forks that share no KV (refused by the cache, or a parked parent):
                                        # the child recomputes instead
    stall_preemptions: int = 0          # stalls broken by releasing a group's idle beams
    idle_beam_releases: int = 0         # idle beams whose KV was released (they keep their candidates)
    failed_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    computed_tokens: int = 0


def generator_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF


def seeded_generators(seed: int | None, n: int) -> list[torch.Generator] | None:
    """One CPU generator per draw of a seeded request; None when unseeded (torch is imported only then)."""
    if seed is None:
        return None
    import torch
    return [torch.Generator().manual_seed(generator_seed(seed, i)) for i in range(n)]
