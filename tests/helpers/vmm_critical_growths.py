"""Why decode growths stay on the step with background mapping on (docs/performance.md): `make run`'s vmm run with
`--background-mapping true`, each decode growth that still maps on the scheduler's thread classified by what its
slot's last map-ahead job found: `nothing` (no free and no parked page when the job ran), `mapped` (it mapped a page
that another growth then took back), `never` (no job since the slot's last growth).

    PYTHONPATH=.:tests python tests/helpers/vmm_critical_growths.py

Wraps two methods for the run (this script's process only); prints counts by (what was free at the growth, what
the job found).
"""
from __future__ import annotations

import contextlib
import io
import sys
from collections import Counter

from kvlab.experiments.cli.launch import main
from kvlab.vmm.allocator import VMMAllocator
from kvlab.vmm.pages import SlotPages

counts: Counter[tuple[str, str]] = Counter()
last_job: dict[int, str] = {}    # slot index -> what its last map-ahead job found
map_ahead, allocate = SlotPages.map_ahead, VMMAllocator.allocate.__wrapped__


def watched_map_ahead(self: SlotPages, index: int, seq_id: int, target: int) -> bool:
    slot = self.table.slots[index]
    stale = slot.seq_id != seq_id or len(slot.groups) >= target
    mapped = map_ahead(self, index, seq_id, target)
    if not stale:
        last_job[index] = "mapped" if mapped else "nothing"
    return mapped


def watched_allocate(self: VMMAllocator, seq, num_tokens: int, reserve_units: int = 0):
    slot = self.table.of(seq.seq_id)
    if slot is not None:
        self.mapper.fence_one(slot.index)
        if num_tokens - slot.held == 1 and self.geo.pages_for(num_tokens) > len(slot.groups):
            free = "parked" if self.table.stale else ("free" if self.free_pages.num_free else "none")
            counts[(free, last_job.pop(slot.index, "never"))] += 1
    return allocate(self, seq, num_tokens, reserve_units)


if __name__ == "__main__":
    SlotPages.map_ahead, VMMAllocator.allocate = watched_map_ahead, watched_allocate
    sys.argv = ["kvlab", "bench", "--model", "tiny", "--backends", "vmm", "--repeats", "1", "--no-progress",
                "--background-mapping", "true", "--out", sys.argv[1] if len(sys.argv) > 1 else "results/critical"]
    with contextlib.redirect_stdout(io.StringIO()):
        main()
    print(f"decode growths on the step: {sum(counts.values())}")
    for (free, job), n in counts.most_common():
        print(f"  at the growth: {free:6s}  its last map-ahead job: {job:7s}  {n}")
