"""kvlab serve end to end: a real uvicorn server on a free loopback port, driven by the official openai client."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.lazy import LazyImport
from helpers.processes import children
from helpers.servers import CONFIG, LiveServer, greedy, wait_for

from kvlab import LLM
from kvlab.common.kv.types import CacheStats
from kvlab.common.metrics import RunMetrics
from kvlab.common.outputs import CompletionOutput, RequestOutput
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.tokenizer import ByteTokenizer
from kvlab.experiments.serve.decoding import Decoding
from kvlab.experiments.serve.health import wait_healthy
from kvlab.experiments.serve.prom import METRICS, ServerMetrics

openai = LazyImport("openai")       # a dev dependency (pyproject [dev])
ROOT = Path(__file__).resolve().parents[1]
# 256 tokens of KV: 8 requests of 31 + 96 tokens must preempt one another
TINY_BUDGET = {"kv_cache_bytes": 1 << 20, "page_size": 4096, "preemption_mode": "recompute"}


@pytest.fixture(scope="module", params=["thread", "process"])
def live(request):
    s = LiveServer(engine=request.param)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**CONFIG)
    yield llm
    llm.close()


def test_completion_chat_and_stream(live):
    c = live.client()
    r = c.completions.create(model="tiny", prompt="hello", **greedy(5))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **greedy(4))
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    chunks = list(c.completions.create(model="tiny", prompt="hello", stream=True,
                                       stream_options={"include_usage": True}, **greedy(5)))
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(live.url + "/health").status_code == 200


def test_greedy_stream_equals_plain_equals_generate(live, reference):
    c = live.client()
    prompt = "The quick brown fox"
    plain = c.completions.create(model="tiny", prompt=prompt, **greedy(12)).choices[0].token_ids
    streamed = [t for ch in c.completions.create(model="tiny", prompt=prompt, stream=True, **greedy(12))
                for t in ch.choices[0].token_ids]
    offline = reference.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert streamed == plain == offline[0].outputs[0].token_ids


def test_token_id_prompt_and_n2(live):
    c = live.client()
    r = c.completions.create(model="tiny", prompt=[1, 80, 81, 82], n=2, max_tokens=6, seed=7,
                             extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert all(len(ch.token_ids) == 6 for ch in r.choices) and r.usage.completion_tokens == 12
    streamed = list(c.completions.create(model="tiny", prompt=[1, 80, 81, 82], n=2, max_tokens=6, seed=7,
                                         stream=True, extra_body={"ignore_eos": True}))
    by_index = {0: [], 1: []}
    for ch in streamed:
        for choice in ch.choices:
            by_index[choice.index] += choice.token_ids
    assert [by_index[0], by_index[1]] == [r.choices[0].token_ids, r.choices[1].token_ids]


def test_stop_string_cuts_text_across_tokens():
    tok = ByteTokenizer(1024, add_bos=False)
    dec = Decoding(tok, 1, ["wor"])
    sent = [dec.add(0, [t])[1] for t in tok.encode("hello world")]
    assert "".join(sent) == "hello " and dec.samples[0].finish_reason == "stop" and dec.all_stopped()


def test_client_disconnect_frees_kv(live):
    aborted = live.metric("kvlab_requests_aborted_total")
    body = {"model": "tiny", "prompt": "disconnect me", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", live.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert live.metric("kvlab_kv_units_used") > 0
    assert wait_for(lambda: live.metric("kvlab_requests_aborted_total") == aborted + 1)
    assert wait_for(lambda: live.metric("kvlab_kv_units_used") == 0)


def test_fifty_concurrent_clients(live, reference):
    prompts = [f"client {i}: " + "x" * (i % 7) for i in range(50)]
    c = live.client()
    ask = lambda p: c.completions.create(model="tiny", prompt=p, **greedy(4)).choices[0].token_ids
    with ThreadPoolExecutor(50) as pool:
        got = list(pool.map(ask, prompts))
    want = [o.outputs[0].token_ids for o in
            reference.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    assert got == want


BAD_BODIES = [
    b"{not json",
    b"[1, 2]",
    json.dumps({"prompt": ""}).encode(),
    json.dumps({"prompt": 5}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 0}).encode(),
    json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(),
    json.dumps({"prompt": "x", "temperature": -1}).encode(),
    json.dumps({"prompt": "x", "top_p": 0}).encode(),
    json.dumps({"prompt": "x", "top_k": 0}).encode(),
    json.dumps({"prompt": "x", "n": 0}).encode(),
    json.dumps({"prompt": "x", "stop_token_ids": [-1]}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 100000}).encode(),          # too long for max_model_len
    json.dumps({"prompt": [1, 10 ** 9]}).encode(),                          # token id outside the vocabulary
    json.dumps({"prompt": "x", "stream": "yes"}).encode(),
    json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}).encode(),
    json.dumps({"prompt": "x", "ignore_eos": 1}).encode(),
    json.dumps({"prompt": "x", "stop": [""]}).encode(),
]


def test_bad_requests_get_openai_400_while_good_one_runs(live):
    c = live.client()
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: c.completions.create(model="tiny", prompt="good", **greedy(40)))
        for body in BAD_BODIES:
            r = httpx.post(live.url + "/v1/completions", content=body, timeout=10,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body
        bad_chat = httpx.post(live.url + "/v1/chat/completions", json={"messages": []}, timeout=10)
        assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages"
        assert good.result(60).usage.completion_tokens == 40
    assert httpx.get(live.url + "/health").status_code == 200


def test_full_waiting_queue_is_429():
    s = LiveServer(max_waiting=0)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        s.stop()


def memfd_count(pid: int | str = "self") -> int:
    count = 0
    for f in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += "memfd" in os.readlink(f)
        except OSError:                         # the fd of the listing itself, closed meanwhile
            pass
    return count


@pytest.mark.slow      # ~7 s; test_serve_process.py stops a real server with SIGTERM and exit 0 in make test
def test_sigterm_during_load_exits_zero():
    memfds = memfd_count()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", "serve", "--model", "tiny",
                             "--backend", "vmm", "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://\S+", line).group(0)
        assert "(engine in its own process, 1 torch thread(s))" in line, line   # --threads 1 here too, as in LLM
        wait_healthy(url, 30, proc)
        body = {"model": "tiny", "prompt": "load", "max_tokens": 500, "ignore_eos": True}
        pool = ThreadPoolExecutor(8)
        futures = [pool.submit(_post_quietly, url, body) for _ in range(8)]
        assert wait_for(lambda: _running(url) > 0, 20)
        kids = children(proc.pid)
        assert any(memfd_count(k) for k in kids), kids      # the engine process holds the vmm page pool
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
        for f in futures:
            f.result(30)                       # every client got an answer or a closed connection
        pool.shutdown()
        assert not [k for k in kids if Path(f"/proc/{k}").exists()]
        assert memfd_count() == memfds
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(r"^kvlab_num_requests_running (\S+)$", text, re.M).group(1))


def _post_quietly(url: str, body: dict) -> int:
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=30).status_code
    except httpx.HTTPError:
        return -1


def test_tiny_budget_attributes_preemptions_and_waiting_to_requests():
    """A KV budget too small for all requests at once: the server reports, per request, the preemptions it
    suffered, the tokens recomputed, the seconds it waited for KV and its share of map/unmap seconds."""
    s = LiveServer(config=TINY_BUDGET)
    try:
        stats = httpx.get(s.url + "/kvlab/stats", timeout=10).json()
        assert stats == {} or stats["kv_units_total"] > 0
        body = {"model": "tiny", "max_tokens": 96, "temperature": 0, "ignore_eos": True}
        def post(i: int) -> dict:
            return httpx.post(s.url + "/v1/completions", json=body | {"prompt": [1] + [40 + i] * 30},
                              timeout=120).json()

        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(post, range(8)))
        ext = [r["kvlab"] for r in rs]
        assert all(e.keys() >= {"kv_wait_s", "recomputed_tokens", "map_unmap_s", "num_preemptions"} for e in ext)
        assert any(e["num_preemptions"] > 0 and e["recomputed_tokens"] > 0 for e in ext), ext
        assert any(e["kv_wait_s"] > 0 for e in ext)
        assert all(e["map_unmap_s"] >= 0 for e in ext)
        streamed = httpx.post(s.url + "/v1/completions", json=body | {"prompt": [1, 2, 3], "stream": True},
                              timeout=60).text
        finals = [json.loads(line[5:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert "kvlab" in finals[-1] and finals[-1]["kvlab"]["recomputed_tokens"] == 0
        stats = httpx.get(s.url + "/kvlab/stats", timeout=10).json()
        assert stats["running"] == 0 and stats["kv_units_total"] > 0
    finally:
        s.stop()


def test_offline_attribution_matches_scheduler_counters():
    """The same fields on RequestOutput.metrics offline: per-request preemptions and recomputed tokens sum to
    the scheduler's counters; a request too long for the cache fails alone and still gets its fields."""
    llm = LLM(**CONFIG, **TINY_BUDGET, max_model_len=512)
    try:
        prompts = [[1] + [40 + i] * 30 for i in range(8)] + [[1] * 300]
        outs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0, ignore_eos=True))
        stats = llm.engine.scheduler_stats()
        ms = [o.metrics for o in outs]
        assert sum(m.num_preemptions for m in ms) == stats.preemptions > 0
        assert sum(m.recomputed_tokens for m in ms) == stats.recomputed_tokens > 0
        assert all(m.kv_wait_s >= 0 and m.map_unmap_s >= 0 for m in ms)
        assert max(m.kv_wait_s for m in ms) > 0 and sum(m.map_unmap_s for m in ms) > 0
        assert outs[-1].error is not None and ms[-1].num_preemptions == 0
    finally:
        llm.close()


def test_an_engine_bug_ends_every_stream_and_health_says_503():
    """Engine.step raising (a bug, not a bad request): every open stream ends with finish_reason "abort" and
    [DONE], the engine's KV is freed, and /health and new requests answer 503 instead of hanging."""
    s = LiveServer()
    try:
        engine, steps = s.engine.loop.engine, []
        real_step = engine.step

        def failing_step():
            steps.append(1)
            if len(steps) > 3:
                raise RuntimeError("injected engine bug")
            return real_step()
        engine.step = failing_step
        body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
        text = httpx.post(s.url + "/v1/completions", json=body, timeout=30).text
        assert text.rstrip().endswith("data: [DONE]") and '"finish_reason": "abort"' in text
        assert s.engine.loop.failed and engine.cache_stats().used_units == 0
        assert httpx.get(s.url + "/health", timeout=5).status_code == 503
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=5).status_code == 503
    finally:
        s.stop()


class RecordedEngine:
    """What ServerMetrics reads from an engine: the cache's stats and the run record."""

    def __init__(self, stats: CacheStats, metrics: RunMetrics) -> None:
        self.stats, self.record = stats, metrics

    def cache_stats(self) -> CacheStats:
        return self.stats

    def metrics(self) -> RunMetrics:
        return self.record

    def reset_metrics(self) -> None:
        self.record = RunMetrics(self.record.backend)


def test_metrics_are_named_from_the_record_with_the_old_names_kept():
    stats = CacheStats("paged", "block", 16, total_units=10, used_units=4, free_units=6, live_tokens=50,
                       allocated_token_slots=64, map_calls=3, map_seconds=0.5)
    engine = RecordedEngine(stats, RunMetrics("paged", preemptions=2, recomputed_tokens=30, num_steps=5))
    m = ServerMetrics("paged")
    for _ in range(2):                                 # counters go to the running totals, not up by them
        m.on_step(engine, 3, 1, 0, force=True)
    text = m.text().decode()
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))      # noqa: E731
    assert value("kvlab_used_units") == value("kvlab_kv_units_used") == 4
    assert value("kvlab_total_units") == value("kvlab_kv_units_total") == 10
    assert value("kvlab_kv_utilization_ratio") == value("kvlab_kv_utilization") == 50 / 64
    assert value("kvlab_num_requests_running") == 3 and value("kvlab_num_requests_waiting") == 1
    assert (value("kvlab_preemptions_total"), value("kvlab_recomputed_tokens_total")) == (2, 30)
    assert (value("kvlab_map_calls_total"), value("kvlab_map_seconds_total")) == (3, 0.5)
    assert m.stats() == {"running": 3, "waiting": 1, "swapped": 0, "used_units": 4, "total_units": 10,
                         "kv_usage_ratio": 0.4, "kv_utilization": 50 / 64, "kv_units_used": 4, "kv_units_total": 10,
                         "mapped_bytes": 0}
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert all(name.startswith("kvlab_") for name in types)
    for e in METRICS:                                  # _total for counters, and only for counters
        total = "_total" if e.kind.__name__ == "Counter" else ""
        assert all(types[name + total] == e.kind.__name__.lower() for name in e.prom_names)
        assert total or not e.prom_name.endswith("_total")

def test_serve_never_imports_the_load_generator():
    """The server side stands alone: the `kvlab` response field lives in serve/extension.py, not in loadgen/."""
    import ast
    imported = set()
    for path in (ROOT / "experiments" / "serve").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert "kvlab.experiments.serve.extension" in imported
    assert not [m for m in imported if m.startswith("kvlab.experiments.loadgen")]


def test_a_known_engine_failure_is_one_log_line_not_a_traceback(caplog):
    """A KvlabError out of Engine.step (a tensor-parallel rank killed under `kvlab serve` raises
    TensorParallelError) ends the loop like a bug does, but is logged as one line naming the cause."""
    from kvlab.common.dist.runner import TensorParallelError
    s = LiveServer()
    try:
        engine = s.engine.loop.engine

        def killed_rank():
            raise TensorParallelError("tensor parallel rank 1 of 2 failed: killed by signal SIGKILL")
        engine.step = killed_rank
        body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True}
        with caplog.at_level("ERROR", logger="kvlab"):
            text = httpx.post(s.url + "/v1/completions", json=body, timeout=30).text
        assert text.rstrip().endswith("data: [DONE]") and s.engine.loop.failed
        failed = [r for r in caplog.records if "engine failed" in r.getMessage()]
        assert len(failed) == 1 and "rank 1 of 2" in failed[0].getMessage() and failed[0].exc_info is None
        assert httpx.get(s.url + "/health", timeout=5).status_code == 503
    finally:
        s.stop()


def test_handoff_totals_are_counters_and_the_stats_block():
    """Engine.handoff.stats.to_dict() running totals -> kvlab_handoff*_total counters (advanced, not added up) and the
    "handoff" block of GET /kvlab/stats; a finished request's handoff -> the latency histogram."""
    stats = CacheStats("vmm", "page", 16, total_units=10, used_units=0, free_units=10)
    totals = {"count": 2, "bytes_copied": 0, "units_moved": 6, "seconds": 0.25, "failed": 1, "expired": 0}
    engine, m = RecordedEngine(stats, RunMetrics("vmm")), ServerMetrics("vmm")
    for _ in range(2):
        m.on_step(engine, 0, 0, 0, force=True, handoffs=totals)
    text = m.text().decode()
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))      # noqa: E731
    assert (value("kvlab_handoffs_total"), value("kvlab_handoff_units_moved_total")) == (2, 6)
    assert (value("kvlab_handoff_seconds_total"), value("kvlab_handoffs_failed_total")) == (0.25, 1)
    assert m.stats()["handoff"] == totals
    out = RequestOutput("r", None, [1], [CompletionOutput(0, [2], None, "length")],
                        handoff={"seconds": 0.003, "bytes_copied": 0, "units_moved": 3, "unit": "page"})
    m.on_finished(out, 0.0)
    assert value_of(m, "kvlab_handoff_latency_seconds_count") == 1
    assert value_of(m, "kvlab_handoff_latency_seconds_sum") == 0.003


def value_of(m: ServerMetrics, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", m.text().decode(), re.M).group(1))
