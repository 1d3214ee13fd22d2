"""Where each sequence of an unfinished request is: waiting, running (admission order, newest last) or swapped
out; the request maps; and the max_num_seqs slot accounting. Moving a sequence's KV is the caller's business."""
from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from kvlab.common.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvlab.common.kv.seam import Allocator
    from kvlab.common.request import Request

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED


class Queues:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # admission order: newest last
        self.swapped: deque[Sequence] = deque()
        self.requests: dict[str, Request] = {}     # unfinished
        self.req_of: dict[int, Request] = {}       # seq_id -> request
        self.finished: list[Request] = []          # finished since the last pop_finished()
        self.kept: dict[int, Sequence] = {}        # finished, KV kept for a handoff (each holds one slot)
        self.held: dict[int, int] = {}             # seq_id -> tokens the cache must have room for to re-admit it
        self.slots_used = 0                        # sum of widths of requests with a running sequence
        self.dirty = False                         # running changed after this step's items were chosen
        self._seq_ids = itertools.count()
        self._admissions = itertools.count()

    def new_seq(self, req: Request, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), req.request_id, token_ids, req.params.max_tokens,
                       req.arrival_time)
        req.seqs.append(seq)
        self.req_of[seq.seq_id] = req
        return seq

    def has_slots(self, req: Request, reserved: int = 0) -> bool:
        """`reserved`: slots this admission keeps for requests ahead of `req` whose KV is on its way."""
        return req.num_running > 0 or self.slots_used + reserved + req.width <= self.max_num_seqs

    def enter_running(self, seq: Sequence, req: Request) -> None:
        seq.status = RUNNING
        seq.admitted_at = next(self._admissions)
        self.running.append(seq)
        if req.num_running == 0:
            self.slots_used += req.width
        req.num_running += 1

    def leave_running(self, req: Request) -> None:
        """Slot accounting only: the caller changes the status and the running list."""
        req.num_running -= 1
        if req.num_running == 0:
            self.slots_used -= req.width

    def keep(self, seq: Sequence, req: Request) -> None:
        """A finished sequence whose KV stays for a handoff: out of running, still holding its slot."""
        self.kept[seq.seq_id] = seq
        self.leave_running(req)
        self.slots_used += 1

    def release_kept(self, seq: Sequence) -> None:
        del self.kept[seq.seq_id]
        self.slots_used -= 1

    def remove_running(self, seq: Sequence) -> None:
        if seq is self.running[-1]:
            self.running.pop()
        else:
            self.running.remove(seq)

    def prune_running(self) -> None:
        """Drop sequences that stopped running; in place, because schedule() holds the list."""
        self.running[:] = [s for s in self.running if s.status is RUNNING]

    def has_proposed(self, seq: Sequence) -> bool:
        """Its group's next step waits for siblings: idle while running, parked while waiting."""
        return self.req_of[seq.seq_id].group.has_proposed(seq)

    def next_waiting(self, passed: set[int] = frozenset()) -> Sequence | None:
        """The first waiting sequence that needs KV now: parked beams wait for their group's next step (and
        admission passes over the `passed` seq ids: imports whose KV is on its way)."""
        for seq in self.waiting:
            if seq.seq_id not in passed and not self.has_proposed(seq):
                return seq
        return None

    def newest_idle(self) -> Sequence | None:
        for seq in reversed(self.running):
            if self.has_proposed(seq):
                return seq
        return None

    def running_of(self, req: Request) -> list[Sequence]:
        return [s for s in self.running if self.req_of[s.seq_id] is req]

    def pop_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done

    def check_invariants(self, cache: Allocator) -> None:
        assert all(s.status is RUNNING for s in self.running)
        assert all(s.status is WAITING for s in self.waiting)
        assert all(s.status is SWAPPED for s in self.swapped)
        assert len(self.running) <= self.max_num_seqs, (len(self.running), self.max_num_seqs)
        live = {id(r): r for r in (self.req_of[s.seq_id] for s in self.running)}
        assert self.slots_used == sum(r.width for r in live.values()) + len(self.kept), "slot accounting drifted"
        assert self.slots_used <= self.max_num_seqs
        for s in self.running:
            assert cache.holds(s), f"running sequence {s.seq_id} holds no KV"
            assert s.num_computed_tokens <= s.num_tokens
        for s in self.kept.values():
            assert cache.holds(s), f"kept sequence {s.seq_id} holds no KV"
        for s in self.waiting:
            assert not cache.holds(s), f"waiting sequence {s.seq_id} still holds KV"
        for s in self.swapped:
            assert not cache.holds(s), f"swapped-out sequence {s.seq_id} still holds resident KV"
        assert set(self.held) <= {s.seq_id for s in (*self.waiting, *self.swapped)}, "a held-back sequence runs"
