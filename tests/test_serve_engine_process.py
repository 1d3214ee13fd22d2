"""`kvlab serve` with the engine in a process of its own: what happens when that process dies, when it cannot
start, and when a terminal's Ctrl-C reaches both processes."""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.processes import alive, children
from helpers.servers import LiveServer, wait_for

from kvlab.common.config import make_config
from kvlab.common.errors import ModelLoadError
from kvlab.common.outputs import CompletionOutput, RequestOutput
from kvlab.common.sampling_params import SamplingParams
from kvlab.experiments.serve import events as ev
from kvlab.experiments.serve.engine_process import ProcessEngine
from kvlab.experiments.serve.handles import EngineHandle

ROOT = Path(__file__).resolve().parents[1]
LONG = {"model": "tiny", "prompt": "long", "max_tokens": 900, "ignore_eos": True}


def test_engine_process_death_fails_requests_and_health_but_not_the_server():
    s = LiveServer(engine="process")
    try:
        engine_pid = s.engine.proc.pid
        with httpx.Client(timeout=30) as h, h.stream("POST", s.url + "/v1/completions",
                                                      json=LONG | {"stream": True}) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(engine_pid, signal.SIGKILL)
            rest = [line for line in lines if line]         # the stream ends instead of hanging
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "abort"' in "".join(rest)
        assert wait_for(lambda: httpx.get(s.url + "/health", timeout=5).status_code == 503)
        r = httpx.post(s.url + "/v1/completions", json=LONG | {"max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(s.url + "/metrics", timeout=10).status_code == 503
        assert httpx.get(s.url + "/v1/models", timeout=10).status_code == 200   # the HTTP side still answers
    finally:
        s.stop()
    assert not alive(engine_pid)


def test_start_up_error_is_raised_in_the_server_and_leaves_no_process():
    before = set(children(os.getpid()))
    with pytest.raises(ModelLoadError):
        ProcessEngine(make_config(model=str(ROOT / "no-such-model")), 8)
    assert set(children(os.getpid())) <= before


@pytest.mark.parametrize("sig, extra", [(signal.SIGINT, []), pytest.param(   # tp2: ~15 s; test_tp_launch.py stops
    signal.SIGTERM, ["--tensor-parallel-size", "2"], marks=pytest.mark.slow)],  # every rank of tp2 by SIGTERM
                         ids=["ctrl-c", "sigterm-tp2"])
def test_a_signal_to_the_process_group_exits_zero_and_stops_every_process(sig, extra):
    """A terminal's Ctrl-C, or `timeout`/`kill -TERM -PGID`, reaches the server, its engine process and (with
    tensor parallelism) the engine's workers at once: all stop, exit 0, nothing leaks."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", "serve", "--model", "tiny",
                             "--backend", "paged", "--port", "0", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = re.search(r"http://\S+", proc.stdout.readline()).group(0)
        engine_pids = children(proc.pid)
        assert engine_pids and all(alive(p) for p in engine_pids)
        assert httpx.post(url + "/v1/completions", json=LONG | {"max_tokens": 3}, timeout=30).status_code == 200
        everyone = [p for e in engine_pids for p in [e, *children(e)]]
        os.killpg(proc.pid, sig)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "leaked" not in err, err
        assert wait_for(lambda: not any(alive(p) for p in everyone), 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_every_message_pickles_as_its_fields():
    """The records crossing the socket pair come back equal, each pickled as (class, field values): no state
    dict per object, the cheap form (one EventBatch per engine step)."""
    out = RequestOutput("r1", None, [1, 2], [CompletionOutput(0, [5, 6], None, "length")])
    messages = [ev.AddCommand("r1", [1, 2], SamplingParams(max_tokens=3)), ev.AbortCommand("r1"), ev.StopCommand(),
                ev.StatsQuery(7), ev.StatsReply(7, b"text", {"running": 1.0}), ev.ProcessSetup(["/x"], 20),
                ev.EngineReady(None, 1, None), ev.EngineFailed(ModelLoadError("no model")),
                ev.EventBatch([ev.AcceptedEvent("r1"), ev.RejectedEvent("r2", "full", 503),
                               ev.TokensEvent("r1", [[5], []]), ev.StepTokens({"r1": [[6]], "r2": [[7]]}, {}),
                               ev.FinishedEvent("r1", out),
                               ev.AbortedEvent("r3")], waiting=2)]
    for msg in messages:
        back = pickle.loads(pickle.dumps(msg))
        assert type(back) is type(msg) and (back == msg or isinstance(msg, ev.EngineFailed)), msg
        cls, fields = msg.__reduce__()
        assert cls is type(msg) and isinstance(fields, tuple), msg
    assert str(pickle.loads(pickle.dumps(messages[7])).error) == "no model"


def test_a_steps_tokens_reach_each_stream_in_order_with_their_logprobs():
    """A step's tokens cross as one StepTokens; the server side hands each stream its TokensEvent, in the engine's
    order, between the events before the step and those after it; a stream that ended gets nothing."""
    got: list[tuple[str, object]] = []
    handle = EngineHandle(8, lambda command: None)
    for rid in ("a", "b", "gone"):
        handle.submit(rid, [1], SamplingParams(max_tokens=2), lambda e, rid=rid: got.append((rid, e)))
    out = RequestOutput("a", None, [1], [CompletionOutput(0, [5, 6], None, "length")])
    lp = [[(-0.5, {5: -0.5})]]
    batch = ev.EventBatch([ev.AcceptedEvent("a"), ev.AcceptedEvent("b"), ev.RejectedEvent("gone", "no", 400),
                           ev.StepTokens({"b": [[7]], "gone": [[8]], "a": [[5, 6]]}, {"a": lp}),
                           ev.FinishedEvent("a", out)], waiting=0)
    handle.deliver(pickle.loads(pickle.dumps(batch)))
    assert got == [("a", ev.AcceptedEvent("a")), ("b", ev.AcceptedEvent("b")), ("gone", ev.RejectedEvent("gone", "no")),
                   ("b", ev.TokensEvent("b", [[7]], None)), ("a", ev.TokensEvent("a", [[5, 6]], lp)),
                   ("a", ev.FinishedEvent("a", out))]
    assert list(handle.streams) == ["b"] and handle.pending == 0


def settled_child(pid: int) -> int:
    """The child that lives on in a session of its own (a forked engine calls setsid() a moment after the fork; a
    short-lived child may come and go first); the first child if none does within 10 s."""
    found: list[int] = []

    def settled() -> bool:
        for child in children(pid):
            with contextlib.suppress(ProcessLookupError):
                if os.getsid(child) != os.getsid(pid):
                    found.append(child)
                    return True
        return False
    return found[0] if wait_for(settled, 10) else children(pid)[0]


def test_ctrl_c_while_the_engine_process_starts_is_no_traceback():
    """The engine process runs in a session of its own: a terminal's Ctrl-C (to the foreground process group) while
    its interpreter starts or imports torch is the server's to handle (one line), never a KeyboardInterrupt
    traceback or "Fatal Python error: init_import_site" of the engine, and nothing is left."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", "serve", "--model", "tiny",
                             "--backend", "paged", "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_for(lambda: children(proc.pid), 60)   # the engine: forked (same command line) or a new python
        engine = settled_child(proc.pid)
        assert os.getpgid(engine) != os.getpgid(proc.pid) and os.getsid(engine) != os.getsid(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert code in (0, 130), (code, err)
    assert wait_for(lambda: not alive(engine), 10)
