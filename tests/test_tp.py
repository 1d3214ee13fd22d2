"""Tensor parallelism (common/dist/): CPU, gloo, 2 ranks. The replay of rank 0's allocation ops is checked
in-process on every backend (fast); one spawned tp=2 run stays in the default suite; the backend x
preemption matrix and the killed-rank teardown are `slow` (each start costs ~20 s on 2 cores). Launch contexts
(unguarded scripts, stdin, the REPL) and SIGTERM: tests/test_tp_launch.py."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers.processes import alive, children

from kvlab.common.config import make_config
from kvlab.common.dist.message import Encoder, Mirror
from kvlab.common.dist.recording import RecordingAllocator
from kvlab.common.dist.runner import TensorParallelError
from kvlab.common.dist.shard import check_tp_size
from kvlab.common.engine import Engine
from kvlab.common.errors import ConfigError
from kvlab.common.kv.seam import KVCache, create_cache
from kvlab.common.llm import LLM
from kvlab.common.presets import TINY_CONFIG, load_tiny
from kvlab.common.runner import TorchRunner
from kvlab.common.sampling_params import SamplingParams

BACKENDS = ("paged", "vmm", "reserve")
TOKENS_PER_KV_BYTE = 4096                      # the tiny model: 4 layers x K,V x 2 heads x 64 x fp32
TIGHT = {"kv_cache_bytes": 160 * TOKENS_PER_KV_BYTE, "page_size": 4096, "block_size": 16,
         "reserve_mode": "oracle", "max_model_len": 128}
PROMPTS = [[(7 * i + j) % 900 + 3 for j in range(12 + 3 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def tight(backend: str, mode: str = "recompute", **extra):
    return dict(TIGHT, backend=backend, preemption_mode=mode, **extra)


def test_tp_size_is_validated():
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        make_config(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="valid sizes: 1, 2$") as info:
        check_tp_size(TINY_CONFIG, 4)
    assert "\n" not in str(info.value)


def run_recorded(backend: str, mode: str) -> tuple[int, list]:
    """Run a preempting workload through a RecordingAllocator and replay every step's message on a second,
    accounting-only allocator (a worker's view); the snapshots must agree after every step."""
    config = make_config(**tight(backend, mode))
    model, _ = load_tiny("float32", "cpu", 0)
    inner = create_cache(config, model.kv_shape())
    recorder = RecordingAllocator(inner.allocator)
    engine = Engine(config, KVCache(recorder, inner.storage, inner.shape), TorchRunner(model, inner.storage),
                    eos_token_ids=(2,), vocab_size=1024)
    worker = create_cache(config, model.kv_shape(), accounting_only=True)
    mirror, encoder = Mirror(worker.allocator), Encoder()
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY)
    engine.add_request(PROMPTS[1], SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=5))   # forks
    try:
        while engine.has_unfinished():
            out = engine.scheduler.schedule()
            mirror.apply(encoder.encode(*recorder.drain(), out.items))
            assert worker.allocator.snapshot() == inner.allocator.snapshot()
            engine.scheduler.update(out, engine.runner.execute(out) if out.items else {}, now=0.0)
            engine.scheduler.pop_finished()
        mirror.apply(encoder.encode(*recorder.drain(), []))
        assert worker.allocator.snapshot() == inner.allocator.snapshot()
        assert worker.allocator.num_free_units() == inner.allocator.num_free_units()
        return engine.scheduler.stats.preemptions, mirror.seqs
    finally:
        engine.close()
        worker.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_ops_keep_allocation_tables_identical(backend, mode):
    preemptions, mirrored = run_recorded(backend, mode)
    # reserve holds each sequence's whole region from admission: it never preempts
    assert (preemptions > 0) == (backend != "reserve"), "paged and vmm must preempt to test replay under it"
    assert not mirrored, "finished sequences are forgotten by the workers"


# -- spawned ranks ------------------------------------------------------------------------------------------

def generate(backend: str, tp: int, mode: str = "recompute", **extra):
    """Greedy tokens, per-step logits (rank 0's model), preemptions and (tp > 1) every rank's info."""
    with LLM(tensor_parallel_size=tp, **tight(backend, mode, **extra)) as llm:
        logits: list[torch.Tensor] = []
        model = llm.engine.runner.model
        forward = model.forward

        def capture(*args, **kwargs):
            out = forward(*args, **kwargs)
            logits.append(out.clone())
            return out
        model.forward = capture
        outs = llm.generate(PROMPTS, GREEDY)
        infos = llm.engine.runner.rank_infos() if tp > 1 else None
        comm = llm.engine.runner.comm_stats() if tp > 1 else None
        return ([o.outputs[0].token_ids for o in outs], logits, llm.metrics().preemptions, infos, comm)


def check_matches(backend: str, mode: str, same_schedule: bool) -> None:
    tokens1, logits1, pre1, _, _ = generate(backend, 1, mode)
    tokens2, logits2, pre2, infos, comm = generate(backend, 2, mode)
    assert (pre1 > 0) == (pre2 > 0) == (backend != "reserve")
    assert tokens2 == tokens1
    if same_schedule:
        assert len(logits2) == len(logits1)
        for a, b in zip(logits1, logits2):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert len({i["digest"] for i in infos}) == 1, "allocation tables differ across ranks"
    assert len({i["free_units"] for i in infos}) == 1
    assert comm["tp_steps"] > 0 and comm["allreduces_per_step"] == 2 * TINY_CONFIG.num_layers


def test_tp2_equals_tp1_paged_with_preemption():
    """The default-suite spawn test: tokens, logits within 1e-5 step by step, one digest across ranks."""
    check_matches("paged", "recompute", same_schedule=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_equals_tp1_matrix(backend, mode):
    # vmm sizes pages per rank (half the bytes per token: twice the tokens per page), so its schedule,
    # hence its per-step batches, may differ from tp=1; its tokens may not
    check_matches(backend, mode, same_schedule=backend != "vmm")


def memfds() -> int:
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if "memfd:" in os.path.realpath(f"/proc/self/fd/{fd}") or
               _link(fd).startswith("/memfd:"))


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


@pytest.mark.slow
def test_killed_rank_is_one_line_and_leaves_nothing():
    before = memfds()
    llm = LLM(tensor_parallel_size=2, **tight("vmm"))
    try:
        pid = llm.engine.runner.rank_infos()[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError) as info:
            llm.generate(PROMPTS, GREEDY)
        text = str(info.value)
        assert "\n" not in text and "rank 1 of 2" in text and "SIGKILL" in text, text
        assert pid not in children(os.getpid()) and not alive(pid)
        with pytest.raises(TensorParallelError, match="shut down"):
            llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()
    assert memfds() == before
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_ctrl_c_tears_down_every_rank():
    import _thread
    import threading
    with LLM(tensor_parallel_size=2, **tight("paged")) as llm:
        pid = llm.engine.runner.rank_infos()[1]["pid"]
        threading.Timer(1.0, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS * 20, GREEDY)
        assert pid not in children(os.getpid()) and not alive(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_close_tears_down_every_rank():
    llm = LLM(tensor_parallel_size=2, **tight("paged"))
    pid = llm.engine.runner.rank_infos()[1]["pid"]
    llm.close()
    assert pid not in children(os.getpid()) and not alive(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
