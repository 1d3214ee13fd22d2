"""One run of prefill/decode disaggregation, or of colocated engines on as many GPUs, on the roofline clock.

Cross-device, every engine has a GPU of its own (fleet.py runs the GPUs in parallel); same-device, prefill engine i
and decode engine i share GPU i (its time, by time slicing, and its KV memory, half each). Colocated: E = P + D
engines each serve whole requests, sent round robin. Disaggregated: P prefill engines compute each prompt and its
first token (prefill charged at the MFU), then the KV goes to one of D decode engines (round robin) through that
engine's handoff channel, one handoff at a time (handoff.py: a copy over the link, or a remap); the decode engine
holds the prompt and the first token (its "prefill" costs only its KV reads: the roofline with prefill off) and
generates the rest. A request's record joins its first token (prefill engine) to the rest (decode engine), so TTFT,
TPOT and ITL are those a client of the pair would see, the handoff inside the first inter-token gap."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from kvlab.experiments.loadgen import latency
from kvlab.experiments.loadgen.latency import RequestRecord
from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.fleet import SimEngine, SimGpu, build_engine, drive
from kvlab.experiments.sim.gpu_figures import LINKS, Link, link
from kvlab.experiments.sim.pd.handoff import Handoff
from kvlab.experiments.sim.roofline import hardware, model_spec
from kvlab.experiments.sim.serve.costs import profile
from kvlab.experiments.sim.serve.run import ServeSpec, plan
from kvlab.experiments.sim.serve.tap import ServeTap
from kvlab.experiments.workloads.requests import Request

SAME_DEVICE = "same-device"
ARRANGEMENTS = ("cross-device", SAME_DEVICE)


@dataclass(frozen=True, slots=True)
class Setup:
    """colocated (handoff None) or disaggregated: "remap" (same device, vmm), "copy" (over `link`; same device: a
    device-to-device copy) or "remote" (cross-device vmm: map the prefill GPU's pages, read them over `link`).
    A bare link name as `handoff` is a copy over it (the older form)."""
    case: SimCase
    handoff: str | None = None
    link: str = ""
    arrangement: str = "cross-device"

    def __post_init__(self) -> None:
        if self.handoff == "remap" and self.arrangement != SAME_DEVICE:
            raise ValueError("a zero-copy remap needs both processes on one device: arrangement='same-device'")

    @property
    def kind(self) -> str | None:
        return "copy" if self.handoff in LINKS else self.handoff

    @property
    def link_name(self) -> str:
        return self.handoff if self.handoff in LINKS else self.link

    @property
    def label(self) -> str:
        if self.handoff is None:
            return f"colocated {self.case.backend_label}"
        where = self.link_name if self.arrangement != SAME_DEVICE else SAME_DEVICE
        how = "remap" if self.kind == "remap" else f"{self.kind}/{where}"
        return f"pd {how} {self.case.backend_label}"


@dataclass(slots=True)
class PdSpec:
    serve: ServeSpec
    prefill: int = 1
    decode: int = 1
    transfer_overhead_s: float = 0.0     # per copy issued (0: bytes only; docs/disaggregation.md)


def make_handoff(setup: Setup, spec: PdSpec) -> Handoff:
    s = spec.serve
    model = model_spec(s.model)
    page = setup.case.options.get("page_size", 0)
    if setup.kind == "remap":
        over = None
    else:
        over = device_copy(s.hardware) if setup.arrangement == SAME_DEVICE else link(setup.link_name)
    common = {"kind": setup.kind, "link": over, "layout": setup.case.layout,
              "set_access": s.set_access, "background": s.background_mapping,
              "transfer_overhead_s": spec.transfer_overhead_s}
    if setup.case.policy == "vmm":
        return Handoff(model, page_size=page, costs=profile(s.driver_profile, None, page), **common)
    return Handoff(model, block_size=setup.case.options["block_size"], **common)


def device_copy(hardware_name: str) -> Link:
    """A device-to-device copy on one GPU: every byte read and written once, at the memory's bandwidth."""
    bw = hardware(hardware_name).bandwidth
    return Link(SAME_DEVICE, bw / 2, f"{hardware_name} memory bandwidth, read + write (roofline.py)")


def engines(setup: Setup, spec: PdSpec, role: str, count: int, requests: list[Request], seed: int) -> list[SimEngine]:
    s = spec.serve
    case = setup.case
    if setup.arrangement == SAME_DEVICE and setup.handoff is not None:     # two processes share a GPU's memory
        case = SimCase(case.policy, case.budget_gb / 2, watermark=case.watermark, **case.options)
    prof = profile(s.driver_profile, s.calibration, case.options.get("page_size"))
    prefill = role != "decode" and s.model_prefill
    tap = ServeTap
    if role == "decode" and setup.kind == "remote":
        tap = remote_tap(link(setup.link_name).bytes_per_s)
    return [build_engine(f"{role}{i}", case, s.settings(seed), requests, s.ledger(prof), prefill, tap_type=tap)
            for i in range(count)]


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


def remote_tap(link_bytes_per_s: float) -> type:
    class Remote(RemoteReadTap):
        bytes_per_s = link_bytes_per_s
    return Remote


class RemoteReadTap(ServeTap):
    """The decode engine of a remote handoff: every step also reads each sequence's prompt KV over the link (the
    pages stay on the prefill GPU), instead of from its own memory: the difference is added to the step."""
    bytes_per_s = 0.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.remote_read_s = 0.0

    def execute(self, out: Any) -> dict[int, int]:
        sampled = super().execute(out)
        cost = self.runner.cost
        remote = sum(min(item.seq.prompt_len, item.start + item.num_tokens) for item in out.items)
        extra = remote * cost.model.kv_bytes_per_token * (1 / self.bytes_per_s - 1 / cost.hardware.bandwidth)
        extra = max(extra, 0.0)
        self.runner.now += extra
        self.remote_read_s += extra
        return sampled


class PdRouter:
    """Sends arrivals to the prefill engines and, when a prompt is done, its KV on to a decode engine."""

    def __init__(self, prefill: list[SimEngine], decode: list[SimEngine], handoff: Handoff,
                 requests: list[Request]) -> None:
        self.prefill, self.decode, self.handoff, self.requests = prefill, decode, handoff, requests
        self.channels = [Channel() for _ in decode]
        self.waits: list[float] = []         # per handoff: queueing + transfer, seconds
        self.bytes_copied = self.units_moved = self.transfers = 0
        self.sender_hidden_s = 0.0
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
        self.transfers += self.handoff.transfers(tokens)
        self.sender_hidden_s += self.handoff.hidden_sender_seconds(tokens)
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


def gpus(setup: Setup, prefill: list[SimEngine], decode: list[SimEngine]) -> list[SimGpu]:
    """One GPU per engine; same-device, prefill i and decode i on one GPU."""
    if setup.arrangement == SAME_DEVICE:
        return [SimGpu([p, d]) for p, d in zip(prefill, decode)]
    return [SimGpu([e]) for e in prefill + decode]


def disaggregated(setup: Setup, spec: PdSpec, requests: list[Request], seed: int) -> dict[str, Any]:
    prefill = engines(setup, spec, "prefill", spec.prefill, requests, seed)
    decode = engines(setup, spec, "decode", spec.decode, requests, seed)
    try:
        router = PdRouter(prefill, decode, make_handoff(setup, spec), requests)
        end = drive(gpus(setup, prefill, decode), router.on_finished)
        records = router.records()
        remote_s = sum(getattr(e.tap, "remote_read_s", 0.0) for e in decode)
    finally:
        for e in prefill + decode:
            e.close()
    result = latency.summarize(records, end, spec.serve.goodput or None, percentiles=spec.serve.percentiles)
    waits = sorted(router.waits)
    result["handoff"] = {"count": len(waits), "bytes_copied": router.bytes_copied,
                         "units_moved": router.units_moved, "transfers": router.transfers, "seconds": sum(waits),
                         "sender_hidden_seconds": router.sender_hidden_s, "remote_read_seconds": remote_s,
                         "arrangement": setup.arrangement,
                         "p99_ms": waits[int(0.99 * (len(waits) - 1))] * 1000 if waits else 0.0}
    return result
