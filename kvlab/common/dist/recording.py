"""Rank 0's allocator, recorded: the scheduler talks to `RecordingAllocator`, which forwards every call to the
real allocator and logs the calls that changed state, so the step message can replay them on every rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlab.common.kv.seam import Allocator

from kvlab.common.kv.types import CacheStats
from kvlab.common.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SeqState:
    """What an allocator may read of a sequence at the moment of a call (token ids travel separately)."""
    seq_id: int
    request_id: str
    prompt_len: int
    max_tokens: int
    adapter_id: str
    num_computed_tokens: int
    num_tokens: int

    @classmethod
    def of(cls, seq: Sequence) -> SeqState:
        return cls(seq.seq_id, seq.request_id, seq.prompt_len, seq.max_tokens, seq.adapter_id,
                   seq.num_computed_tokens, seq.num_tokens)


# one op: (method name, states of the sequences it took, extra arguments)
Op = tuple[str, tuple[SeqState, ...], tuple[Any, ...]]


class RecordingAllocator(Allocator):
    """Forwards to `inner`; `drain()` hands over the state-changing calls since the last drain, and the
    sequences they touched (whose token ids the message must carry)."""

    def __init__(self, inner: Allocator) -> None:
        self.inner = inner
        self.name, self.unit_name, self.tokens_per_unit = inner.name, inner.unit_name, inner.tokens_per_unit
        self.ops: list[Op] = []
        self.touched: dict[int, Sequence] = {}

    def _log(self, method: str, seqs: tuple[Sequence, ...], states: tuple[SeqState, ...], *args: Any) -> None:
        self.ops.append((method, states, args))
        for s in seqs:
            self.touched[s.seq_id] = s

    def drain(self) -> tuple[list[Op], dict[int, Sequence]]:
        ops, touched = self.ops, self.touched
        self.ops, self.touched = [], {}
        return ops, touched

    # -- queries: forwarded, not recorded ------------------------------------------------------------------
    @property
    def allocator_seconds(self) -> float:       # type: ignore[override]
        return self.inner.allocator_seconds

    def num_total_units(self) -> int:
        return self.inner.num_total_units()

    def num_free_units(self) -> int:
        return self.inner.num_free_units()

    def max_tokens_per_seq(self) -> int:
        return self.inner.max_tokens_per_seq()

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        return self.inner.units_needed(seq, num_tokens)

    def holds(self, seq: Sequence) -> bool:
        return self.inner.holds(seq)

    def stats(self) -> CacheStats:
        return self.inner.stats()

    def snapshot(self) -> dict[str, Any]:
        return self.inner.snapshot()

    def check_invariants(self) -> None:
        self.inner.check_invariants()

    def close(self) -> None:
        self.inner.close()

    # -- state changes: forwarded, then recorded if they changed anything ----------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        state = SeqState.of(seq)
        hit = self.inner.allocate(seq, num_tokens, reserve_units)
        if hit is not None:
            self._log("allocate", (seq,), (state,), num_tokens, reserve_units, hit)
        return hit

    def free(self, seq: Sequence) -> None:
        state = SeqState.of(seq)
        self.inner.free(seq)
        self._log("free", (seq,), (state,))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        states = (SeqState.of(parent), SeqState.of(child))
        self.inner.fork(parent, child)           # raises (nothing changed) when it cannot share
        self._log("fork", (parent, child), states)

    def swap_out(self, seq: Sequence) -> None:
        state = SeqState.of(seq)
        self.inner.swap_out(seq)
        self._log("swap_out", (seq,), (state,))

    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        state = SeqState.of(seq)
        ok = self.inner.swap_in(seq, reserve_units)
        if ok:
            self._log("swap_in", (seq,), (state,), reserve_units)
        return ok
