"""Making room: idle beams are released first (newest first), then running sequences are preempted one at a
time, newest admitted first, by recompute or swap (`preemption_mode`); alone, a sequence that cannot grow
fails, unless the cache says its shortage is transient (memory shared with other engines): then it is preempted
and held back until the cache has room for its end (common/sched/admission.py). At a stall, the newest group's
idle beams are released, or the queue head that cannot fit even in an empty cache fails alone (a transient
shortage: it waits)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvlab.common.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvlab.common.kv.seam import Allocator
    from kvlab.common.request import SchedulerOutput, SchedulerStats
    from kvlab.common.sched.lifecycle import Lifecycle
    from kvlab.common.sched.queues import Queues

log = logging.getLogger("kvlab.scheduler")

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED


class Preemption:
    def __init__(self, cache: Allocator, queues: Queues, life: Lifecycle, stats: SchedulerStats,
                 mode: str) -> None:
        self.cache = cache
        self.queues = queues
        self.life = life
        self.stats = stats
        self.swap = mode == "swap"

    def make_room(self, seq: Sequence, target: int, i: int, out: SchedulerOutput) -> int:
        """Release idle beams (newest first), then preempt the newest running sequence until `seq` can grow to
        `target` (allocating it) or is itself preempted; alone, it fails. Returns how many removed sequences
        sat before index i (already handled this step)."""
        running = self.queues.running
        removed_before = 0
        while self.cache.allocate(seq, target) is None:
            idle = self.queues.newest_idle()
            victim = idle if idle is not None else running[-1]
            if victim is seq and len(running) == 1:
                if not self.cache.shortage_is_transient(seq, target):
                    req = self.queues.req_of[seq.seq_id]
                    self.life.fail(req, f"request {req.request_id} cannot grow to {target} tokens even alone in "
                                        f"the {self.cache.name} cache: raise kv_cache_bytes or lower max_tokens", out)
                    return removed_before
                self._hold_back(seq, target)
            removed_before += running.index(victim) < i
            if idle is not None:
                self.release_idle([idle], out)
            else:
                self.preempt_all([victim], out)
            if seq.status is not RUNNING:
                break
        return removed_before

    def _hold_back(self, seq: Sequence, target: int) -> None:
        """Preempted alone for a transient shortage: it comes back when the cache can hold it to its end (or to
        `target` if its end can never fit). Re-admitted as soon as its next chunk fits, it would recompute its
        prompt only to be preempted again at its next unit while other engines hold the memory."""
        end = seq.final_len
        self.queues.held[seq.seq_id] = end if self.cache.shortage_is_transient(seq, end) else target

    def release_idle(self, beams: list[Sequence], out: SchedulerOutput) -> None:
        """Free the KV of idle beams (running, candidates in): they keep their candidates and stay parked in
        the waiting queue until their group's next step, when a continuing beam recomputes its tokens."""
        self.stats.idle_beam_releases += len(beams)
        self.preempt_all(beams, out, force_recompute=True)

    def preempt_all(self, seqs: list[Sequence], out: SchedulerOutput, force_recompute: bool = False) -> None:
        """Preempt `seqs` (in running order)."""
        for seq in reversed(seqs):               # newest first, so the oldest ends up at the queue front
            self.queues.remove_running(seq)
            self._preempt(seq, out, force_recompute)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, force_recompute: bool) -> None:
        queues, stats = self.queues, self.stats
        req = queues.req_of[seq.seq_id]
        queues.leave_running(req)
        req.num_preemptions += 1
        stats.preemptions += 1
        queues.dirty = True
        if self.swap and not force_recompute and seq.num_computed_tokens > 0:
            self.cache.swap_out(seq)
            seq.status = SWAPPED
            queues.swapped.appendleft(seq)
            out.swapped_out.append(seq)
            stats.swap_preemptions += 1
            return
        self.cache.free(seq)
        stats.recompute_preemptions += 1
        stats.recomputed_tokens += seq.num_computed_tokens
        req.attribution.recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.status = WAITING                     # a beam's candidates stay: they depend only on its tokens
        queues.waiting.appendleft(seq)
        out.preempted.append(seq)

    def break_stall(self, out: SchedulerOutput) -> None:
        """Nothing could be scheduled although requests remain. Either every running sequence is an idle beam
        whose siblings do not fit: release the newest group's idle beams (parked, they do not come back
        before their group's next step, so each stall frees KV for other work); or nothing runs and the
        queue head cannot fit even in an empty cache: it fails alone."""
        queues = self.queues
        if queues.running:
            beams = queues.running_of(queues.req_of[queues.running[-1].seq_id])
            log.info("stall: releasing the KV of request %s's %d idle beams so waiting work can run",
                     beams[0].request_id, len(beams))
            self.stats.stall_preemptions += 1
            self.release_idle(beams, out)
            return
        head = queues.swapped[0] if queues.swapped else queues.next_waiting()
        if head is None:
            raise RuntimeError("scheduler stall with nothing running, swapped or admissible: every waiting "
                               "sequence is a parked beam (a group stepped without its last proposal?)")
        tokens = head.num_computed_tokens if head.status is SWAPPED else head.num_tokens
        if self.cache.shortage_is_transient(head, tokens):
            return                               # other engines hold the memory: it waits for them
        req = queues.req_of[head.seq_id]
        self.life.fail(req, f"request {req.request_id} does not fit even in an empty {self.cache.name} cache "
                            f"({head.num_tokens} tokens): raise kv_cache_bytes or lower max_tokens", out)
