"""One run of prefill/decode disaggregation, or of colocated engines on as many GPUs, on the roofline clock.

Every engine has a GPU of its own (fleet.py runs the GPUs in parallel). Colocated: E = P + D engines each serve
whole requests, sent round robin. Disaggregated: P prefill engines compute each prompt and its first token (prefill
charged at the MFU), then the KV goes to one of D decode engines (round robin) through that engine's handoff
channel, one handoff at a time (handoff.py: a copy over the link, or a remap); the decode engine holds the prompt
and the first token (its "prefill" costs only its KV reads: the roofline with prefill off) and generates the rest.
A request's record joins its first token (prefill engine) to the rest (decode engine), so TTFT, TPOT and ITL are
those a client of the pair would see, the handoff inside the first inter-token gap."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from kvlab.experiments.loadgen import latency
from kvlab.experiments.loadgen.latency import RequestRecord
from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.fleet import SimEngine, SimGpu, build_engine, drive
from kvlab.experiments.sim.gpu_figures import link
from kvlab.experiments.sim.pd.handoff import Handoff
from kvlab.experiments.sim.roofline import model_spec
from kvlab.experiments.sim.serve.costs import CostLedger, profile
from kvlab.experiments.sim.serve.run import ServeSpec, plan
from kvlab.experiments.workloads.requests import Request


@dataclass(frozen=True, slots=True)
class Setup:
    """colocated (handoff None) or disaggregated with a handoff: copy over `link`, or remap (link "")."""
    case: SimCase
    handoff: str | None = None        # None: colocated; "remap"; or a link name (nvlink, pcie): a copy

    @property
    def label(self) -> str:
        how = "colocated" if self.handoff is None else "pd " + ("remap" if self.handoff == "remap"
                                                               else f"copy/{self.handoff}")
        return f"{how} {self.case.backend_label}"


@dataclass(slots=True)
class PdSpec:
    serve: ServeSpec
    prefill: int = 1
    decode: int = 1


def make_handoff(setup: Setup, spec: PdSpec) -> Handoff:
    model = model_spec(spec.serve.model)
    if setup.handoff == "remap":
        page = setup.case.options["page_size"]
        return Handoff(model, page_size=page, costs=profile(spec.serve.driver_profile, None, page))
    return Handoff(model, link=link(setup.handoff))


def engines(setup: Setup, spec: PdSpec, role: str, count: int, requests: list[Request], seed: int) -> list[SimEngine]:
    s = spec.serve
    prof = profile(s.driver_profile, s.calibration, setup.case.options.get("page_size"))
    prefill = role != "decode" and s.model_prefill
    return [build_engine(f"{role}{i}", setup.case, s.settings(seed), requests, CostLedger(prof, s.background_mapping),
                         prefill) for i in range(count)]


class Channel:
    """One decode engine's handoff channel: one handoff at a time, each booked in the earliest free gap from the
    moment it is ready. Senders on different GPUs book out of time order (a long step that started first ends
    after a short one that started later), so the channel keeps its bookings, not just its last end."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []     # (start, end), sorted and disjoint

    def book(self, ready: float, seconds: float) -> float:
        """When a handoff ready at `ready` and lasting `seconds` ends."""
        start = ready
        for s, e in self.busy:
            if e <= start:
                continue
            if s >= start + seconds:
                break
            start = e
        bisect.insort(self.busy, (start, start + seconds))
        return start + seconds


class PdRouter:
    """Sends arrivals to the prefill engines and, when a prompt is done, its KV on to a decode engine."""

    def __init__(self, prefill: list[SimEngine], decode: list[SimEngine], handoff: Handoff,
                 requests: list[Request]) -> None:
        self.prefill, self.decode, self.handoff, self.requests = prefill, decode, handoff, requests
        self.channels = [Channel() for _ in decode]
        self.waits: list[float] = []         # per handoff: queueing + transfer, seconds
        self.bytes_copied = self.units_moved = 0
        for k, r in enumerate(requests):
            prefill[k % len(prefill)].send(Request(r.prompt_len, 1, r.arrival_s), r.arrival_s, k)

    def on_finished(self, gpu: SimGpu, engine: SimEngine, outputs: list[Any]) -> None:
        if engine not in self.prefill:
            return
        for out in outputs:
            k = engine.tags[out.request_id]
            r = self.requests[k]
            if r.output_len > 1:
                self.hand_off(gpu, k, r)

    def hand_off(self, gpu: SimGpu, k: int, r: Request) -> None:
        d = k % len(self.decode)
        tokens = r.prompt_len + 1
        done = self.channels[d].book(gpu.clock, self.handoff.seconds(tokens))
        self.waits.append(done - gpu.clock)
        self.bytes_copied += self.handoff.bytes_copied(tokens)
        self.units_moved += self.handoff.units_moved(tokens)
        gpu.charge(self.handoff.sender_seconds(tokens))
        self.decode[d].send(Request(tokens, r.output_len - 1, done), done, k)

    def records(self) -> list[RequestRecord]:
        first = by_tag(self.prefill)
        rest = by_tag(self.decode)
        return [joined(r, first.get(k, []), rest.get(k, [])) for k, r in enumerate(self.requests)]


def by_tag(group: list[SimEngine]) -> dict[int, list[float]]:
    """Each request's token times in a group of engines, by the router's tag."""
    return {e.tags[rid]: e.token_times(rid) for e in group for rid, _ in e.added}


def joined(r: Request, first: list[float], rest: list[float]) -> RequestRecord:
    times = first[:1] + rest
    ok = len(times) == r.output_len
    rec = RequestRecord(success=ok, prompt_len=r.prompt_len, output_tokens=len(times), start=r.arrival_s,
                        error="" if ok else f"{len(times)} of {r.output_len} tokens")
    if times:
        rec.ttft = times[0] - r.arrival_s
        rec.itl = [b - a for a, b in zip(times, times[1:])]
        rec.latency = times[-1] - r.arrival_s
    return rec


def run_point(setup: Setup, spec: PdSpec, rate: float, seed: int) -> dict[str, Any]:
    requests = plan(spec.serve, rate, seed)
    point = {"setup": setup.label, "request_rate": rate, "seed": seed, "num_prompts": len(requests)}
    if setup.handoff is None:
        return {**point, **colocated(setup, spec, requests, seed)}
    return {**point, **disaggregated(setup, spec, requests, seed)}


def colocated(setup: Setup, spec: PdSpec, requests: list[Request], seed: int) -> dict[str, Any]:
    group = engines(setup, spec, "colocated", spec.prefill + spec.decode, requests, seed)
    try:
        for k, r in enumerate(requests):
            group[k % len(group)].send(r, r.arrival_s, k)
        end = drive([SimGpu([e]) for e in group])
        records = [rec for e in group for rec in e.tap.records(e.added, e.finished)]
    finally:
        for e in group:
            e.close()
    return latency.summarize(records, end, spec.serve.goodput or None, percentiles=spec.serve.percentiles)


def disaggregated(setup: Setup, spec: PdSpec, requests: list[Request], seed: int) -> dict[str, Any]:
    prefill = engines(setup, spec, "prefill", spec.prefill, requests, seed)
    decode = engines(setup, spec, "decode", spec.decode, requests, seed)
    try:
        router = PdRouter(prefill, decode, make_handoff(setup, spec), requests)
        end = drive([SimGpu([e]) for e in prefill + decode], router.on_finished)
        records = router.records()
    finally:
        for e in prefill + decode:
            e.close()
    result = latency.summarize(records, end, spec.serve.goodput or None, percentiles=spec.serve.percentiles)
    waits = sorted(router.waits)
    result["handoff"] = {"count": len(waits), "bytes_copied": router.bytes_copied,
                         "units_moved": router.units_moved, "seconds": sum(waits),
                         "p99_ms": waits[int(0.99 * (len(waits) - 1))] * 1000 if waits else 0.0}
    return result
