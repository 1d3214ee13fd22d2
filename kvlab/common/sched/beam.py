"""One step of beam search, as a pure function over the live beams' candidates.

Semantics (the brute-force test in tests/test_llm.py re-implements them independently):
- every live beam proposes up to 2*W candidates (token, log-probability), scored by beam score + logprob;
- candidates are taken best first (ties: earlier beam, then the runner's candidate order); a stop token
  (EOS unless ignore_eos, or a stop_token_id) ends a hypothesis, kept only if it ranks within the top W
  candidates; other candidates become the next live beams until there are W of them;
- beams reaching max_tokens become hypotheses ("length");
- search ends when no beam is live, or when W hypotheses exist and the best live beam cannot beat the W-th
  best of them (exact without a length penalty: scores only decrease).
BeamGroup (common/sched/groups.py) applies the result to the cache: parents with several children fork,
parents with none free.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvlab.common.outputs import BeamHypothesis
from kvlab.common.sequence import Sequence


@dataclass(slots=True)
class BeamChoice:
    parent: Sequence
    token: int
    logprob: float
    score: float


@dataclass(slots=True)
class BeamState:
    width: int
    live: list[Sequence] = field(default_factory=list)
    stash: dict[int, list[tuple[int, float]]] = field(default_factory=dict)   # seq_id -> candidates
    hyps: list[BeamHypothesis] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        """Every live beam has proposed its candidates for this step."""
        return len(self.stash) == len(self.live)

    def best(self, n: int) -> list[BeamHypothesis]:
        return sorted(self.hyps, key=lambda h: -h.score)[:n]


def select_beams(state: BeamState, is_stop: Callable[[int], bool], max_tokens: int) -> list[BeamChoice]:
    """Consume the stash, record finished hypotheses in state.hyps, return the next live beams, best first."""
    cands = []
    for b, beam in enumerate(state.live):
        for rank, (tok, lp) in enumerate(state.stash[beam.seq_id]):
            cands.append((-(beam.cumulative_logprob + lp), b, rank, tok, lp))
    cands.sort()
    state.stash.clear()
    chosen: list[BeamChoice] = []
    for position, (neg_score, b, _, tok, lp) in enumerate(cands):
        parent = state.live[b]
        if is_stop(tok):
            if position < state.width:
                state.hyps.append(BeamHypothesis(-neg_score, parent.output_token_ids + [tok], "stop"))
            continue
        chosen.append(BeamChoice(parent, tok, lp, -neg_score))
        if len(chosen) == state.width:
            break
    if chosen and chosen[0].parent.num_output_tokens + 1 >= max_tokens:
        state.hyps.extend(BeamHypothesis(c.score, c.parent.output_token_ids + [c.token], "length")
                          for c in chosen)
        return []
    if chosen and len(state.hyps) >= state.width:
        worst_kept = state.best(state.width)[-1].score
        if chosen[0].score <= worst_kept:
            return []
    return chosen
