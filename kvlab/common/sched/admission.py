"""Admission: swapped sequences come back first (FCFS), then waiting ones are admitted FCFS (parked beams are
passed over) while max_num_seqs has slots for their request and the cache can hold this step's chunk and
still keep the watermark free. The watermark applies only to a request with nothing running while something
else runs: a lone request is never blocked by it, and a recomputing sibling of running work is growth. A
sequence preempted alone for a transient shortage (common/sched/preemption.py) is held back until the cache has
room for its end. A decode request whose KV is on its way (a worker pulls it) is passed over, its slot and the
units it needs kept back from the requests behind it once its pull has started."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.common.errors import HandoffError
from kvlab.common.request import PULL_QUEUED, PULLING
from kvlab.common.sched.groups import add_item

if TYPE_CHECKING:
    from kvlab.common.kv.seam import Allocator
    from kvlab.common.request import Request, SchedulerOutput, SchedulerStats
    from kvlab.common.sched.lifecycle import Lifecycle
    from kvlab.common.sched.queues import Queues
    from kvlab.common.sequence import Sequence


class Admission:
    def __init__(self, cache: Allocator, queues: Queues, stats: SchedulerStats, watermark: float,
                 life: Lifecycle) -> None:
        self.cache = cache
        self.queues = queues
        self.stats = stats
        self.life = life
        self.watermark_units = int(watermark * cache.num_total_units())

    def watermark(self, req: Request) -> int:
        """Free units a (re)admission must leave: none when nothing runs (a lone request is never blocked)
        or when the request already runs (a sibling of admitted work grows it, like decode growth)."""
        return self.watermark_units if self.queues.running and req.num_running == 0 else 0

    def held_back(self, seq: Sequence) -> bool:
        """Whether `seq`, preempted alone for a transient shortage, waits on: until the cache has room for the
        tokens it is held for, or until they can never fit (then it comes back, and fails alone if it must)."""
        tokens = self.queues.held.get(seq.seq_id)
        if tokens is None:
            return False
        cache = self.cache
        if cache.units_needed(seq, tokens) > cache.num_free_units() and cache.shortage_is_transient(seq, tokens):
            return True
        del self.queues.held[seq.seq_id]
        return False

    def swap_in(self, out: SchedulerOutput, budget: int) -> int:
        cache, queues = self.cache, self.queues
        while queues.swapped and budget > 0:
            seq = queues.swapped[0]
            req = queues.req_of[seq.seq_id]
            if not queues.has_slots(req) or self.held_back(seq):
                break
            if not cache.swap_in(seq, self.watermark(req)):
                break
            queues.swapped.popleft()
            queues.enter_running(seq, req)
            out.swapped_in.append(seq)
            self.stats.swap_ins += 1
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 0 and cache.allocate(seq, seq.num_computed_tokens + n) is not None:
                add_item(out, req, seq, seq.num_computed_tokens, n)
                budget -= n
        return budget

    def _import(self, req: Request, seq: Sequence, reserve: int) -> int | None:
        """A decode request's first allocation: its prompt's KV pulled from the prefill engine (None: no room yet;
        PULLING, PULL_QUEUED: not there yet)."""
        hit = req.kv_import(req, seq, reserve)
        if hit is not None and hit >= 0:
            req.kv_import = None
        return hit

    def admit(self, out: SchedulerOutput, budget: int) -> None:
        cache, queues = self.cache, self.queues
        passed: set[int] = set()                     # imports whose KV is on its way: a slow peer holds up no queue
        slots = units = 0                            # what they keep back from the requests behind them
        while budget > 0:
            seq = queues.next_waiting(passed)
            if seq is None:
                break
            req = queues.req_of[seq.seq_id]
            if not queues.has_slots(req, slots) or self.held_back(seq):
                break
            reserve = self.watermark(req) + units
            target = seq.num_computed_tokens + min(seq.num_tokens - seq.num_computed_tokens, budget)
            if req.kv_import is not None:
                try:
                    hit = target = self._import(req, seq, reserve)  # allocated so far: the prompt; its next chunk below
                except HandoffError as exc:
                    self.life.fail(req, f"request {req.request_id}: {exc}", out, type(exc))
                    continue
                if hit in (PULLING, PULL_QUEUED):
                    passed.add(seq.seq_id)
                    out.pulling += 1
                    if hit == PULLING:
                        slots += req.width
                        units += cache.units_needed(seq, seq.num_tokens)
                    continue
            else:
                hit = cache.allocate(seq, target, reserve)
            if hit is None:
                break
            queues.waiting.remove(seq)               # the head, unless parked beams or pulling imports precede it
            queues.enter_running(seq, req)
            out.admitted.append(seq)
            if hit:        # a prefix hit, or a decode request's imported KV (its whole prompt)
                seq.num_computed_tokens = max(seq.num_computed_tokens, min(hit, seq.num_tokens - 1))
            start = seq.num_computed_tokens
            if target <= start:              # the prefix hit covered this chunk: take the next one
                target = start + min(seq.num_tokens - start, budget)
                if cache.allocate(seq, target) is None:
                    continue
            add_item(out, req, seq, start, target - start)
            budget -= target - start
