"""ServeTap: a runner wrapper for the simulator that timestamps every sampled token on the simulated clock and
charges driver costs (costs.py) in the step that issued them. With a zero profile it changes nothing.

Per-request memory attribution (the keys `kvlab bench serve` gets from a kvlab server): waits, preemptions and
recomputed tokens come from the engine's RequestMetrics (common/sched/attribution.py, on the simulated clock);
map_unmap_s is the SIMULATED driver time, not host time: each step's ledger charge (exposed + hidden) split
evenly over the requests of the sequences holding KV in that step, the engine's apportioning rule."""
from __future__ import annotations

from collections import defaultdict
from operator import sub
from typing import Any

from kvlab.common.kv.registry import get_backend
from kvlab.experiments.loadgen.latency import RequestRecord
from kvlab.experiments.serve.extension import kvlab_extension
from kvlab.experiments.sim.roofline import RooflineRunner
from kvlab.experiments.sim.serve.costs import CostLedger, StepOps
from kvlab.experiments.sim.serve.early_stop import SloWatch

TABLE_ENTRY_BYTES = 4          # one int32 block id per block in the uploaded table


class ServeTap:
    def __init__(self, runner: RooflineRunner, cache: Any, ledger: CostLedger, watch: SloWatch | None = None,
                 layers_per_page: int = 1) -> None:
        self.runner, self.ledger = runner, ledger
        # a cross-layer vmm case is booked on per-layer pages this many times smaller (sim/layouts.py): each
        # real page, and each real map call, stands for this many of the booked ones
        self.layers_per_page = layers_per_page
        self.watch = watch if watch is not None and watch.active else None   # raises SloMissed to stop the run
        allocator = cache.allocator
        self.driver_stats = getattr(getattr(allocator, "driver", None), "stats", None)   # vmm: the driver's counters
        # a backend of the paged layout uploads a block table each step: one entry per unit
        paged = get_backend(allocator.name).layout == "paged"
        self.block_size = allocator.tokens_per_unit if paged else 0
        self.last = self._counters()
        self.tokens: defaultdict[str, list[float]] = defaultdict(list)   # request id -> its tokens' times
        self.zero = ledger.profile.is_zero
        self.engine: Any = None
        self.map_unmap: dict[str, list[float]] = {}     # request id -> [driver seconds, of them exposed]
        self.unattributed_s = 0.0                       # driver seconds charged in a step with no KV holder

    def bind(self, engine: Any) -> None:
        self.engine = engine

    def _counters(self) -> tuple[int, int, int]:
        d = self.driver_stats
        return (d.pages_mapped, d.map_calls, d.pages_unmapped) if d is not None else (0, 0, 0)

    def clock(self) -> float:
        return self.runner.clock()

    def execute(self, out: Any) -> dict[int, int]:
        before = self.runner.now
        sampled = self.runner.execute(out)
        if not self.zero and out.items:
            driver, exposed = self.ledger.driver_s, self.ledger.exposed_s
            charged = self.ledger.charge(self.step_ops(out), self.runner.now - before)
            self.runner.now += charged
            self.runner.driver_seconds += charged
            if self.ledger.driver_s != driver:
                self.apportion(self.ledger.driver_s - driver, self.ledger.exposed_s - exposed)
        now = self.runner.now
        tokens, watch = self.tokens, self.watch
        for item in out.items:         # once per running sequence per step, so kept flat
            if item.needs_logits:
                seq = item.seq
                times = tokens[seq.request_id]
                times.append(now)
                if watch is not None:
                    count = len(times)
                    if count == 1 or count == seq.max_tokens:
                        watch.on_token(seq.request_id, count, seq.arrival_time, seq.max_tokens, now)
        if watch is not None:
            watch.check(now)
        return sampled

    def step_ops(self, out: Any) -> StepOps:
        counters = self._counters()
        mapped, calls, unmapped = ((a - b) // self.layers_per_page for a, b in zip(counters, self.last))
        self.last = counters
        table = kv_read = 0.0
        if self.block_size:
            bs = self.block_size
            contexts = [item.start + item.num_tokens for item in out.items]
            table = sum(-(-c // bs) for c in contexts) * TABLE_ENTRY_BYTES
            cost = self.runner.cost
            kv_read = sum(contexts) * cost.model.kv_bytes_per_token / cost.hardware.bandwidth
        return StepOps(mapped, calls, unmapped, int(table), kv_read)

    def apportion(self, driver_s: float, exposed_s: float) -> None:
        """This step's driver seconds, split evenly over the requests of the sequences holding KV in it."""
        engine = self.engine
        holders = engine.attributor.holders(engine.scheduler.running) if engine is not None else []
        if not holders:
            self.unattributed_s += driver_s
            return
        share, exposed = driver_s / len(holders), exposed_s / len(holders)
        for req in holders:
            acc = self.map_unmap.setdefault(req.request_id, [0.0, 0.0])
            acc[0] += share
            acc[1] += exposed

    def attribution(self, request_id: str, m: Any) -> dict[str, Any]:
        """What a kvlab server would send in the response's `kvlab` field (m: the request's RequestMetrics)."""
        driver, exposed = self.map_unmap.get(request_id, (0.0, 0.0))
        if m is None:
            return {"map_unmap_s": driver, "map_unmap_exposed_s": exposed}
        return kvlab_extension(m) | {"map_unmap_s": driver, "map_unmap_exposed_s": exposed}

    def records(self, added: list[tuple[str, Any]], finished: dict[str, Any]) -> list[RequestRecord]:
        """One client-side record per request, timed from its send (its arrival, or later when the client's
        max_concurrency held it back: the engine's arrival_time), from its tokens' simulated times."""
        out = []
        for request_id, req in added:
            times = self.tokens.get(request_id, [])
            m = finished.get(request_id)
            sent = m.arrival_time if m is not None else req.arrival_s
            ok = len(times) == req.output_len
            rec = RequestRecord(success=ok, prompt_len=req.prompt_len, output_tokens=len(times), start=sent,
                                error="" if ok else f"{len(times)} of {req.output_len} tokens",
                                kvlab=self.attribution(request_id, m))
            if times:
                rec.ttft = times[0] - sent
                rec.itl = list(map(sub, times[1:], times))
                rec.latency = times[-1] - sent
            out.append(rec)
        return out
