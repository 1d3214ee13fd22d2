"""Several simulated engines on several simulated GPUs: each engine is the real scheduler over an accounting-only
cache with its own roofline runner and serving tap (token times, driver costs); each GPU has one clock.

Engines on one GPU share it by time slicing: one step at a time, round robin over the engines with work (a decode
step is bound by HBM bandwidth, so steps of engines run side by side would take about as long together). GPUs run
in parallel: the loop always steps the GPU whose next event is earliest, so an engine never sees a request sent
to it later than its own clock by more than the sender's one step. Used by `simulate pool` (engines sharing one
GPU) and `simulate pd` (prefill and decode engines, one GPU each)."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.common.sampling_params import SamplingParams
from kvlab.experiments.sim.core import PROMPT_TOKEN, SimCase, SimSettings, case_config, make_runner
from kvlab.experiments.sim.layouts import layers_per_page
from kvlab.experiments.sim.roofline import RooflineCost, RooflineRunner, hardware, model_spec
from kvlab.experiments.sim.serve.costs import CostLedger
from kvlab.experiments.sim.serve.tap import ServeTap
from kvlab.experiments.workloads.requests import Request

_order = itertools.count()      # ties in an engine's arrival heap keep insertion order


@dataclass(eq=False)
class SimEngine:
    """One engine: its tap (token times and driver costs on its runner's clock) and what was sent to it."""
    name: str
    engine: Any
    runner: RooflineRunner
    tap: ServeTap
    inbox: list = field(default_factory=list)        # heap of (time, order, Request, tag)
    added: list = field(default_factory=list)        # (request id, Request) in the order added
    tags: dict[str, Any] = field(default_factory=dict)   # request id -> the caller's tag
    finished: dict[str, Any] = field(default_factory=dict)
    holds_back: Callable[[], bool] | None = None    # True while it should wait for memory instead of stepping

    def send(self, request: Request, at: float, tag: Any = None) -> None:
        heapq.heappush(self.inbox, (at, next(_order), request, tag))

    def next_arrival(self) -> float:
        return self.inbox[0][0] if self.inbox else float("inf")

    def admit(self, now: float) -> None:
        """Add every request whose time has come."""
        while self.inbox and self.inbox[0][0] <= now:
            at, _, r, tag = heapq.heappop(self.inbox)
            prompt = [PROMPT_TOKEN] * r.prompt_len
            rid = self.engine.add_request(prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                          arrival_time=at)
            self.added.append((rid, r))
            self.tags[rid] = tag

    def busy(self) -> bool:
        return self.engine.has_unfinished() and not (self.holds_back is not None and self.holds_back())

    def step(self, now: float) -> tuple[float, list[Any]]:
        """One step starting at `now`: the clock after it, and the request outputs it finished."""
        self.runner.now = now
        done = self.engine.step().finished
        for out in done:
            self.finished[out.request_id] = out.metrics
        return self.runner.now, done

    def token_times(self, request_id: str) -> list[float]:
        return self.tap.tokens.get(request_id, [])

    def close(self) -> None:
        self.engine.close()


@dataclass(eq=False)
class SimGpu:
    """One device's clock and the engines time-sharing it."""
    engines: list[SimEngine]
    clock: float = 0.0
    turn: int = 0
    extra_s: float = 0.0          # time a caller charged to this GPU between steps (e.g. a handoff's unmaps)

    def next_event(self) -> float:
        if any(e.busy() for e in self.engines):
            return self.clock
        return max(self.clock, min(e.next_arrival() for e in self.engines))

    def step(self) -> tuple[SimEngine, list[Any]] | None:
        """Admit what has arrived, then step the next engine with work in round-robin order."""
        self.clock = self.next_event()
        for e in self.engines:
            e.admit(self.clock)
        n = len(self.engines)
        for k in range(n):
            i = (self.turn + k) % n
            if self.engines[i].busy():
                self.turn = i + 1
                self.clock, done = self.engines[i].step(self.clock)
                return self.engines[i], done
        return None

    def charge(self, seconds: float) -> None:
        self.clock += seconds
        self.extra_s += seconds


def drive(gpus: list[SimGpu], on_finished: Callable[[SimGpu, SimEngine, list[Any]], None] | None = None) -> float:
    """Run every GPU until no engine has work or mail; `on_finished(gpu, engine, outputs)` after each step that
    finished requests (it may send requests on). Returns the last clock."""
    while True:
        gpu = min(gpus, key=SimGpu.next_event)
        if gpu.next_event() == float("inf"):
            held = [e for g in gpus for e in g.engines if e.engine.has_unfinished()]
            if not held:
                return max(g.clock for g in gpus)
            for e in held:            # every engine waits for memory nobody will free: let their schedulers decide
                e.holds_back = None
        stepped = gpu.step()
        if stepped is not None and stepped[1] and on_finished is not None:
            on_finished(gpu, *stepped)


def build_engine(name: str, case: SimCase, settings: SimSettings, requests: list[Request], ledger: CostLedger,
                 model_prefill: bool, watch: Any = None, make_cache: Callable[[Any, Any], Any] | None = None,
                 tap_type: type = ServeTap) -> SimEngine:
    """An engine sized for `requests` (the scheduler's limits, as `simulate`'s), on its own roofline runner.
    `make_cache(config, shape)`: the caller's accounting-only cache (the shared pool's); else the backend's."""
    from kvlab.common.engine import Engine
    from kvlab.common.kv.seam import create_cache
    spec = model_spec(settings.model, settings.dtype, settings.engine.get("kv_cache_dtype", "auto"))
    cost = RooflineCost(hardware(settings.hardware), spec, model_prefill, settings.mfu)
    config = case_config(case, settings, requests)
    if make_cache is None:
        cache = create_cache(config, spec.kv_shape(), accounting_only=True)
    else:
        cache = make_cache(config, spec.kv_shape())
    runner = make_runner(cost, case, settings, cache)
    tap = tap_type(runner, cache, ledger, watch, layers_per_page(case.options, spec))
    engine = Engine(config, cache, tap, timeline_every=10**9, stream_tokens=False)
    tap.bind(engine)
    engine.reset_metrics()
    return SimEngine(name, engine, runner, tap)
