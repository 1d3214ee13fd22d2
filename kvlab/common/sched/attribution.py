"""Per-request KV attribution, kept by the engine on the runner's clock: seconds a request waits with no sequence
running (from arrival to first admission, and while preempted or swapped out; admission and preemption happen in
`schedule()`, so the clock read just before it dates them), and its share of each step's map+unmap seconds,
split evenly over the sequences that held KV in that step (the backends count map/unmap seconds per cache, not
per sequence). Recomputed tokens are counted where the preemption happens (preemption.py)."""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.common.request import Request, SchedulerOutput
    from kvlab.common.sequence import Sequence


class KVAttributor:
    def __init__(self, req_of: dict[int, Request]) -> None:
        self.req_of = req_of                     # the scheduler's seq_id -> request map (read only)
        self.map_unmap_s = 0.0                   # the cache's map+unmap seconds at the last step's end

    @staticmethod
    def on_arrival(req: Request) -> None:
        req.attribution.wait_since = req.arrival_time

    def on_schedule(self, out: SchedulerOutput, now: float) -> None:
        """`out` was just scheduled at `now`: requests left with nothing running start waiting, admitted ones stop."""
        for seq in chain(out.preempted, out.swapped_out):
            req = self.req_of.get(seq.seq_id)
            if req is not None and req.num_running == 0 and req.attribution.wait_since is None:
                req.attribution.wait_since = now
        for seq in chain(out.admitted, out.swapped_in):    # only these can end a wait
            req = self.req_of.get(seq.seq_id)
            if req is not None and req.num_running > 0 and req.attribution.wait_since is not None:
                req.attribution.kv_wait_s += now - req.attribution.wait_since
                req.attribution.wait_since = None

    def holders(self, running: list[Sequence]) -> list[Request]:
        """The request of each sequence holding KV in this step (one entry per sequence)."""
        get = self.req_of.get
        return [r for s in running if (r := get(s.seq_id)) is not None]

    def on_step_end(self, held: list[Sequence], finished: list[Request], map_unmap_s: float) -> None:
        """Split the map+unmap seconds spent since the last step over the requests of the sequences that held KV in
        this step (`held`: the running list before the step's update; `finished`: requests completed in it, no
        longer in req_of). Most steps map nothing (paged and reserve never do), so the requests are looked up
        only when there is something to split."""
        delta, self.map_unmap_s = map_unmap_s - self.map_unmap_s, map_unmap_s
        if not held or delta <= 0:
            return
        done = {s.seq_id: r for r in finished for s in r.seqs}
        holders = [r for s in held if (r := self.req_of.get(s.seq_id) or done.get(s.seq_id)) is not None]
        share = delta / len(holders) if holders else 0.0
        for req in holders:
            req.attribution.map_unmap_s += share

    @staticmethod
    def on_finished(req: Request) -> None:
        att = req.attribution
        if att.wait_since is not None and req.finished_time is not None:      # failed (or ended) while waiting
            att.kv_wait_s += max(0.0, req.finished_time - att.wait_since)
            att.wait_since = None
