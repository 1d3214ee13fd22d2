"""Rank 0's runner: the one scheduler's allocator is recorded; once per step `execute` broadcasts one
message (the step's allocation ops and the batch), then runs rank 0's shard (whose all-reduces pair with
the workers') and samples. A rank that dies surfaces as one TensorParallelError line naming the rank and
why; every other rank is then torn down. `close()` (LLM.close -> Engine.close), Ctrl-C and SIGTERM tear down all."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch.distributed as dist
from kvlab.common.dist.group import Groups, destroy_groups, free_port, init_groups, rank_device
from kvlab.common.dist.launch import Worker, WorkerTask, start_worker
from kvlab.common.dist.message import Encoder, StepMessage
from kvlab.common.dist.recording import RecordingAllocator
from kvlab.common.dist.shard import CommTimer, build_shard, check_tp_size, model_reader
from kvlab.common.dist.worker import rank_cache, rank_info
from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.kv.seam import KVCache
from kvlab.common.runner import TorchRunner
from kvlab.common.weights import first_line

JOIN_TIMEOUT_S = 10
log = logging.getLogger(__name__)


class TensorParallelError(KvlabError, RuntimeError):
    """A rank failed; every rank has been shut down."""


def build_tp(config: Any, model: Any) -> tuple[KVCache, TPRunner]:
    """Start ranks 1..tp-1, shard `model` (the full model) for rank 0, and build rank 0's cache whose
    allocator the scheduler sees through a RecordingAllocator."""
    tp = config.tensor_parallel_size
    check_tp_size(model.config, tp)
    if dist.is_initialized():
        raise ConfigError("a tensor-parallel engine is already running in this process: close it first")
    port = free_port()
    runner = TPRunner(config)
    try:
        for rank in range(1, tp):
            runner.workers.append(start_worker(WorkerTask(rank, tp, port, config, os.getpid())))
        runner.start(model, port)
    except BaseException as e:
        raise runner.failure(e) from None
    return runner.cache, runner


def on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM while tensor-parallel ranks run: unwind like Ctrl-C (every `with`/`finally` releases, every
    rank is stopped) and exit 143 (128 + SIGTERM), instead of dying with the ranks' resources in flight."""
    log.warning("SIGTERM: stopping every tensor-parallel rank")
    raise SystemExit(128 + signum)


def catch_sigterm() -> None:
    """Install on_sigterm unless the program handles SIGTERM itself (or this is not the main thread)."""
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_sigterm)


def release_sigterm() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class TPRunner:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.workers: list[Worker] = []
        self.groups: Groups | None = None               # set by start()
        self.encoder = Encoder()
        self.timer = CommTimer()
        self.broadcast_s = self.step_s = 0.0
        self.steps = 0
        self.closed = False
        catch_sigterm()

    def start(self, model: Any, port: int) -> None:
        tp, device = self.config.tensor_parallel_size, rank_device(self.config.device, 0)
        self.groups = init_groups(0, tp, port, self.config.device)
        shard = build_shard(model.config, 0, tp, model_reader(model), model.dtype, device, self.groups.device,
                            self.timer)
        shard.use_linear(self.config.linear)
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
        for w in self.workers:
            w.wait(timeout=1.0)
        reports = {w.rank: w.report() for w in self.workers}
        self.shutdown(graceful=False)
        if not isinstance(exc, Exception):
            return exc
        dead = [(w.rank, reports[w.rank] or w.exit_reason()) for w in self.workers
                if w.proc.returncode not in (None, 0) or reports[w.rank]]
        if dead:
            rank, why = dead[0]
            return TensorParallelError(f"tensor parallel rank {rank} of {self.config.tensor_parallel_size} "
                                       f"failed: {why}; all ranks were shut down")
        if isinstance(exc, KvlabError):
            return exc
        return TensorParallelError(f"tensor parallel rank 0 failed: {type(exc).__name__}: {first_line(exc)}; "
                                   "all ranks were shut down")

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and self.groups is not None:
            try:
                box = [("stop", StepMessage([], {}, []))]
                dist.broadcast_object_list(box, src=0, group=self.groups.control)
            except Exception:  # noqa: BLE001 (a rank already gone: killed below)
                pass
        for w in self.workers:
            w.wait(timeout=JOIN_TIMEOUT_S if graceful else 0.5)
        for w in self.workers:
            w.close()                                   # kills a straggler, reaps every process
        destroy_groups()
        release_sigterm()

    def close(self) -> None:
        self.shutdown(graceful=True)
