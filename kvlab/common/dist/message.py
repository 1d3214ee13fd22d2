"""The one message rank 0 broadcasts per step, and the worker side that applies it.

A step message carries the allocation ops recorded since the last step, the token ids the workers' mirror
sequences lack (only the new tail of each touched sequence), the ids of finished sequences to forget, and
the batch. `Mirror` keeps each worker's Sequence copies, replays the ops on the worker's own allocator and
rebuilds the batch items over its copies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.dist.recording import Op, SeqState
from kvlab.common.kv.seam import Allocator
from kvlab.common.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class StepMessage:
    ops: list[Op]
    tokens: dict[int, tuple[int, list[int]]]            # seq id -> (offset, token ids from offset)
    items: list[tuple[int, int, int, bool, int]]        # seq id, start, num_tokens, needs_logits, computed
    forget: list[int] = field(default_factory=list)


class Encoder:
    """Rank 0: remembers how many token ids of each sequence the workers already have."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def encode(self, ops: list[Op], touched: dict[int, Sequence], items: list[BatchItem]) -> StepMessage:
        seqs = dict(touched)
        seqs.update((it.seq.seq_id, it.seq) for it in items)
        tokens = {}
        for sid, seq in seqs.items():
            offset = self.sent.get(sid, 0)
            if seq.num_tokens > offset:
                tokens[sid] = (offset, seq.token_ids[offset:])
                self.sent[sid] = seq.num_tokens
        forget = [sid for sid, seq in touched.items() if seq.status is SequenceStatus.FINISHED]
        for sid in forget:
            self.sent.pop(sid, None)
        batch = [(it.seq.seq_id, it.start, it.num_tokens, it.needs_logits, it.seq.num_computed_tokens)
                 for it in items]
        return StepMessage(ops, tokens, batch, forget)


class ReplayError(RuntimeError):
    """A worker's allocator answered an op differently from rank 0's: the tables diverged."""


class Mirror:
    """A worker's copies of rank 0's sequences, and the replay of rank 0's allocation ops."""

    def __init__(self, allocator: Allocator) -> None:
        self.allocator = allocator
        self.seqs: dict[int, Sequence] = {}

    def apply(self, msg: StepMessage) -> list[BatchItem]:
        for sid, (offset, ids) in msg.tokens.items():
            seq = self.seqs.setdefault(sid, Sequence(sid, "", [], 0))
            del seq.token_ids[offset:]
            seq.token_ids.extend(ids)
        for op in msg.ops:
            self.replay(op)
        for sid in msg.forget:
            self.seqs.pop(sid, None)
        items = []
        for sid, start, num_tokens, needs_logits, computed in msg.items:
            seq = self.seqs[sid]
            seq.num_computed_tokens = computed
            items.append(BatchItem(seq, start, num_tokens, needs_logits))
        return items

    def seq_at(self, state: SeqState) -> Sequence:
        """The mirror as the allocator saw it at the call: the same counters and token prefix."""
        seq = self.seqs.setdefault(state.seq_id, Sequence(state.seq_id, "", [], 0))
        seq.request_id, seq.prompt_len, seq.max_tokens = state.request_id, state.prompt_len, state.max_tokens
        seq.adapter_id, seq.num_computed_tokens = state.adapter_id, state.num_computed_tokens
        return seq

    def replay(self, op: Op) -> None:
        method, states, args = op
        seqs = [self.seq_at(s) for s in states]
        full = [s.token_ids for s in seqs]
        for seq, state in zip(seqs, states):
            seq.token_ids = seq.token_ids[:state.num_tokens]
        try:
            self.call(method, seqs, args)
        finally:
            for seq, ids in zip(seqs, full):
                seq.token_ids = ids

    def call(self, method: str, seqs: list[Sequence], args: tuple[Any, ...]) -> None:
        a = self.allocator
        if method == "allocate":
            num_tokens, reserve, hit = args
            got = a.allocate(seqs[0], num_tokens, reserve)
            if got != hit:
                raise ReplayError(f"allocate(seq {seqs[0].seq_id}, {num_tokens}) gave {got}, rank 0 got {hit}")
        elif method == "swap_in":
            if not a.swap_in(seqs[0], *args):
                raise ReplayError(f"swap_in(seq {seqs[0].seq_id}) found no room that rank 0 found")
        elif method in ("free", "swap_out", "fork"):
            getattr(a, method)(*seqs)
        else:
            raise ReplayError(f"unknown allocation op {method!r}")
