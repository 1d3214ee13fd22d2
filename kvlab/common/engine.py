"""The engine loop: schedule -> runner.execute -> update, with metrics. Backend- and runner-neutral.

Low-level use (bench, simulator):
    engine = Engine(config, cache, runner, eos_token_ids=...)      # any runner with execute() and clock()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        result = engine.step()         # StepResult: result.new_tokens (per request, per sample), result.finished
    engine.metrics()                                                # RunMetrics since reset_metrics()
`Engine.from_config(config)` loads the model and builds the real cache and a TorchRunner.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.common.errors import KvlabError, RequestError
from kvlab.common.handoff.side import HandoffRole
from kvlab.common.kv.seam import create_cache
from kvlab.common.kv.types import CacheStats
from kvlab.common.metrics import MetricsRecorder, RunMetrics
from kvlab.common.outputs import StepResult
from kvlab.common.request import Request, SchedulerOutput, SchedulerStats
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.sched.attribution import KVAttributor
from kvlab.common.sched.scheduler import Scheduler
from kvlab.common.stream import TokenStream, request_output
from kvlab.common.tokenizer import prompt_tokens

if TYPE_CHECKING:
    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence

PULL_WAIT_S = 0.02             # a step with nothing to run waits at most this for a KV pull on its way


class Runner(Protocol):
    def execute(self, out: SchedulerOutput) -> dict[int, Any]: ...

    def clock(self) -> float: ...


class Engine:
    """The loop (add_request, step, abort) and what callers may see of it: the read-only views the LLM API, the
    server and the experiments need, so none reaches into the scheduler. What a step returns is built in
    common/outputs.py. `handoff` is the engine's part in prefill/decode disaggregation (common/handoff/side.py:
    its stats, its address, `poll()` while idle)."""

    def __init__(self, config: EngineConfig, cache: KVCache, runner: Runner, tokenizer: Any = None,
                 eos_token_ids: tuple[int, ...] = (), vocab_size: int | None = None,
                 timeline_every: int = 1, stream_tokens: bool = True) -> None:
        self.config = config
        self.cache = cache
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.scheduler = Scheduler(config, cache.allocator, eos_token_ids)
        self.recorder = MetricsRecorder(cache, timeline_every)
        self.attributor = KVAttributor(self.scheduler.req_of)
        # stream_tokens=False: step() returns finished outputs only, no per-request deltas (the simulator reads
        # none, and building them is per token per sequence work)
        self.stream = TokenStream() if stream_tokens else None
        self._ids = itertools.count()
        self._closed = False
        self.lock = threading.RLock()      # held by step and add_request; the handoff server's thread takes it too
        try:
            self.handoff = HandoffRole(config, cache, self.scheduler, self.lock, vocab_size)
        except BaseException:              # a role this cache cannot take: release what was built for it
            self._release_parts()
            raise

    @classmethod
    def from_model(cls, config: EngineConfig, model: Any, tokenizer: Any = None, **kwargs: Any) -> Engine:
        """Real cache + TorchRunner around an already built model."""
        from kvlab.common.runner import TorchRunner, check_model_len
        check_model_len(config.max_model_len, model.config.max_position_embeddings)   # before any memory is taken
        if config.tensor_parallel_size > 1:      # tensor parallelism: spawned ranks, see common/dist/
            from kvlab.common.dist.runner import build_tp
            cache, runner = build_tp(config, model)
        else:
            cache = create_cache(config, model.kv_shape(config.dtype, config.device))
            model.use_linear(config.linear)
            runner = TorchRunner(model, cache.storage, seed=config.seed, max_model_len=config.max_model_len)
        c = model.config
        return cls(config, cache, runner, tokenizer, c.eos_token_ids, c.vocab_size, **kwargs)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> Engine:
        from kvlab.common.loader import load_model
        model, tokenizer = load_model(config.model, config.dtype, config.device, config.seed)
        return cls.from_model(config, model, tokenizer, **kwargs)

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> str:
        """Queue one request; raises RequestError if it is invalid. Returns its id. `kv_transfer_params`: on a
        prefill engine {"do_remote_decode": True}, on a decode engine the prefill engine's answer
        (docs/disaggregation.md)."""
        self._check_open()
        try:
            return self._add(prompt, params, request_id, arrival_time, kv_transfer_params)
        except RequestError:
            self.handoff.decline_refused(kv_transfer_params)     # a refused decode request never pulls its KV
            raise

    def _add(self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
             arrival_time: float | None, kv_transfer_params: dict[str, Any] | None) -> str:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = prompt_tokens(prompt, self.tokenizer, self.vocab_size)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        arrival = self.runner.clock() if arrival_time is None else arrival_time
        with self.lock:
            params, keep_kv, kv_import = self.handoff.intake(params, kv_transfer_params, len(token_ids))
            req = self.scheduler.add(request_id, token_ids, params, arrival, text, keep_kv, kv_import)
            self.attributor.on_arrival(req)
            self.handoff.release_unpulled(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV; it produces no output. False if it is unknown or already finished."""
        with self.lock:
            if self.stream is not None:
                self.stream.forget(str(request_id))
            req = self.scheduler.requests.get(str(request_id))
            aborted = self.scheduler.abort(str(request_id))
            self.handoff.release_unpulled(req)
            return aborted

    def abort_all(self, request_ids: Iterable[str]) -> None:
        """Abort these requests and discard every output not yet returned: the engine is left empty of them."""
        for request_id in request_ids:
            self.abort(request_id)
        for req in self.scheduler.pop_finished():
            if self.stream is not None:
                self.stream.forget(req.request_id)

    def has_unfinished(self) -> bool:
        """Requests still running, or finished ones whose output the next step() returns."""
        return self.scheduler.has_unfinished() or self.scheduler.has_finished()

    def running_sequences(self) -> list[Sequence]:
        """The sequences holding KV now, oldest admission first (a copy)."""
        return list(self.scheduler.running)

    def queue_depths(self) -> tuple[int, int, int]:
        """(running, waiting, swapped) sequences."""
        s = self.scheduler
        return len(s.running), len(s.waiting), len(s.swapped)

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One iteration: each request's new tokens, and the requests that finished (or failed) in it. When nothing
        ran but KV pulls are on their way (decode role), it then waits a little for one, without the lock."""
        self._check_open()
        with self.lock:
            result = self._step()
            idle = not self.scheduler.running
        if idle:
            self.handoff.wait_for_pull(PULL_WAIT_S)
        return result

    def _step(self) -> StepResult:
        self.handoff.poll()
        held, sampled, stats = self._advance()
        finished = self.scheduler.pop_finished()
        self.attributor.on_step_end(held, finished, stats.map_seconds + stats.unmap_seconds)
        outputs = []
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        for req in finished:
            self.attributor.on_finished(req)
            self.recorder.on_finished(req)
            outputs.append(request_output(req, decode))
            self.handoff.finished(req, outputs[-1])
        if self.stream is None:
            return StepResult(finished=outputs)
        return self.stream.step(sampled, outputs)

    def _advance(self) -> tuple[list[Sequence], list[Request], CacheStats]:
        """schedule -> execute -> update, timed and recorded. Returns the sequences holding KV during the step,
        the requests that sampled in it and the cache's stats after it."""
        clock = self.runner.clock
        t0, w0 = clock(), time.perf_counter()
        out = self.scheduler.schedule()
        self.attributor.on_schedule(out, t0)
        held = list(self.scheduler.running)
        w1 = time.perf_counter()
        sampled = sampled_requests(self.scheduler.req_of, out) if self.stream is not None else []
        samples = self.runner.execute(out) if out.items else {}
        w2 = time.perf_counter()
        t1 = clock()
        self.scheduler.update(out, samples, now=t1)
        w3 = time.perf_counter()
        if self.config.check_invariants:
            self.scheduler.check_invariants()
            self.cache.check_invariants()
        stats = self.cache.stats()
        if out.items:
            self.recorder.on_step(t0, t1, out, len(held), (w1 - w0) + (w3 - w2), stats)
        return held, sampled, stats

    # -- observability --------------------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        self.recorder.start(self.runner.clock(), self.scheduler.stats)

    def metrics(self) -> RunMetrics:
        return self.recorder.result(self.config.backend, self.scheduler.stats)

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's counters since the engine was built (preemptions, swaps, fork fallbacks...)."""
        return self.scheduler.stats

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise KvlabError("this engine is closed (its KV cache is released): build a new one")

    def close(self) -> None:
        if not self._closed:
            with self.lock:
                self._closed = True
                self.handoff.close()
            self._release_parts()

    def _release_parts(self) -> None:
        try:
            self.cache.close()
        finally:
            if hasattr(self.runner, "close"):    # e.g. the tensor-parallel runner's ranks
                self.runner.close()


def sampled_requests(req_of: dict[int, Request], out: SchedulerOutput) -> list[Request]:
    """The requests whose sequences sample in this step, once each, in schedule order (a request whose item the
    scheduler dropped may be gone from `req_of` already)."""
    return [req for req in dict.fromkeys(map(req_of.get, out.specs)) if req is not None]
