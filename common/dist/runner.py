"""Rank 0's runner: the one scheduler's allocator is recorded; once per step `execute` broadcasts one
message (the step's allocation ops and the batch), then runs rank 0's shard (whose all-reduces pair with
the workers') and samples. A rank that dies surfaces as one TensorParallelError line naming the rank and
why; every other rank is then torn down. `close()` (LLM.close -> Engine.close) and Ctrl-C tear down all."""
from __future__ import annotations

import signal
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from kvlab.common.dist.group import destroy_groups, free_port, init_groups, rank_device
from kvlab.common.dist.message import Encoder, StepMessage
from kvlab.common.dist.recording import RecordingAllocator
from kvlab.common.dist.shard import CommTimer, build_shard, check_tp_size, model_reader
from kvlab.common.dist.worker import rank_cache, rank_info, worker_main
from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.kv.seam import KVCache
from kvlab.common.runner import TorchRunner
from kvlab.common.weights import first_line

JOIN_TIMEOUT_S = 10


class TensorParallelError(KvlabError, RuntimeError):
    """A rank failed; every rank has been shut down."""


def build_tp(config: Any, model: Any) -> tuple[KVCache, TPRunner]:
    """Spawn ranks 1..tp-1, shard `model` (the full model) for rank 0, and build rank 0's cache whose
    allocator the scheduler sees through a RecordingAllocator."""
    tp = config.tensor_parallel_size
    check_tp_size(model.config, tp)
    if dist.is_initialized():
        raise ConfigError("a tensor-parallel engine is already running in this process: close it first")
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker_main, args=(r, tp, port, config, errors), name=f"kvlab-tp-rank{r}",
                         daemon=True) for r in range(1, tp)]
    for p in procs:
        p.start()
    runner = TPRunner(config, procs, errors)
    try:
        runner.start(model, port)
    except BaseException as e:
        raise runner.failure(e) from None
    return runner.cache, runner


class TPRunner:
    def __init__(self, config: Any, procs: list, errors: Any) -> None:
        self.config, self.procs, self.errors = config, procs, errors
        self.encoder = Encoder()
        self.timer = CommTimer()
        self.broadcast_s = self.step_s = 0.0
        self.steps = 0
        self.closed = False

    def start(self, model: Any, port: int) -> None:
        tp, device = self.config.tensor_parallel_size, rank_device(self.config.device, 0)
        self.groups = init_groups(0, tp, port, self.config.device)
        shard = build_shard(model.config, 0, tp, model_reader(model), model.dtype, device, self.groups.device,
                            self.timer)
        inner = rank_cache(self.config, shard, 0)
        self.recorder = RecordingAllocator(inner.allocator)
        self.cache = KVCache(allocator=self.recorder, storage=inner.storage, shape=inner.shape)
        self.local = TorchRunner(shard, inner.storage, seed=self.config.seed, max_model_len=self.config.max_model_len)
        self.model = shard
        infos = self.rank_infos()
        if len({i["digest"] for i in infos}) != 1 or len({i["total_units"] for i in infos}) != 1:
            raise TensorParallelError(f"ranks built different KV caches: {infos}")

    def clock(self) -> float:
        return time.perf_counter()

    # -- the step ---------------------------------------------------------------------------------------
    def send(self, kind: str, items: list) -> float:
        """Broadcast one message (the ops recorded since the last one, and `items`); returns its seconds."""
        if self.closed:
            raise TensorParallelError("the tensor-parallel ranks were shut down: build a new engine")
        ops, touched = self.recorder.drain()
        box = [(kind, self.encoder.encode(ops, touched, items))]
        start = time.perf_counter()
        dist.broadcast_object_list(box, src=0, group=self.groups.control)
        return time.perf_counter() - start

    def execute(self, out: Any) -> dict:
        start = time.perf_counter()
        try:
            self.broadcast_s += self.send("step", out.items)
            sampled = self.local.execute(out)
        except TensorParallelError:
            raise
        except BaseException as e:     # Ctrl-C included: the ranks are out of step now, so tear them all down
            error = self.failure(e)
            if error is e:
                raise
            raise error from None
        self.step_s += time.perf_counter() - start
        self.steps += 1
        return sampled

    def rank_infos(self) -> list[dict[str, Any]]:
        """Every rank's allocator digest and KV bytes (pending ops are replayed first)."""
        self.send("info", [])
        infos: list[Any] = [None] * self.config.tensor_parallel_size
        dist.all_gather_object(infos, rank_info(self.cache), group=self.groups.control)
        return infos

    def comm_stats(self) -> dict[str, float]:
        """Per-step communication on rank 0: broadcast and all-reduce µs, and their share of the step."""
        steps = max(self.steps, 1)
        comm = self.broadcast_s + self.timer.allreduce_s
        return {"tp_steps": self.steps, "broadcast_us": 1e6 * self.broadcast_s / steps,
                "allreduce_us": 1e6 * self.timer.allreduce_s / steps,
                "allreduces_per_step": self.timer.allreduces / steps,
                "step_us": 1e6 * self.step_s / steps, "comm_share": comm / self.step_s if self.step_s else 0.0}

    def reset_comm_stats(self) -> None:
        self.broadcast_s = self.step_s = self.timer.allreduce_s = 0.0
        self.steps = self.timer.allreduces = 0

    # -- teardown ---------------------------------------------------------------------------------------
    def failure(self, exc: BaseException) -> BaseException:
        """Tear every rank down; a dead worker becomes one TensorParallelError line (which rank, why)."""
        for p in self.procs:
            p.join(timeout=1.0)
        reports = self.drain_errors()
        self.shutdown(graceful=False)
        if not isinstance(exc, Exception):
            return exc
        dead = [(r, reports.get(r) or exit_reason(p.exitcode)) for r, p in enumerate(self.procs, 1)
                if p.exitcode not in (None, 0) or r in reports]
        if dead:
            rank, why = dead[0]
            return TensorParallelError(f"tensor parallel rank {rank} of {len(self.procs) + 1} failed: {why}; "
                                       "all ranks were shut down")
        if isinstance(exc, KvlabError):
            return exc
        return TensorParallelError(f"tensor parallel rank 0 failed: {type(exc).__name__}: {first_line(exc)}; "
                                   "all ranks were shut down")

    def drain_errors(self) -> dict[int, str]:
        reports = {}
        while True:
            try:
                rank, text = self.errors.get(timeout=0.1)
            except Exception:  # noqa: BLE001 (queue.Empty, or a closed queue)
                return reports
            reports.setdefault(rank, text)

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                box = [("stop", StepMessage([], {}, []))]
                dist.broadcast_object_list(box, src=0, group=self.groups.control)
            except Exception:  # noqa: BLE001 (a rank already gone: terminate below)
                pass
        for p in self.procs:
            p.join(timeout=JOIN_TIMEOUT_S if graceful else 0.5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=JOIN_TIMEOUT_S)
        destroy_groups()
        self.errors.close()

    def close(self) -> None:
        self.shutdown(graceful=True)


def exit_reason(code: int | None) -> str:
    if code is None:
        return "did not answer (still running; killed)"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"
