"""kvlab serve --role router in front of real prefill and decode servers (subprocesses, tiny model): the official
openai client against it; 503 while no engine of a role is alive; a decode server killed mid-stream fails only
its own requests; a client that leaves aborts the request upstream; its flags fail in one line."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from helpers.lazy import LazyImport
from helpers.servers import ServeProcess, engine, router

from kvlab.experiments.cli.main import main
from kvlab.experiments.serve import server
from kvlab.experiments.serve.health import wait_healthy

openai = LazyImport("openai")
BACKEND = "vmm"
LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair():
    """One prefill and two decode servers (vmm, one pool) and the router in front of them."""
    procs: list[ServeProcess] = []
    try:
        for role in ("prefill", "decode", "decode"):
            procs.append(engine(BACKEND, role))
        procs.append(router(procs[:1], procs[1:]))
        wait_healthy(procs[-1].url, 30, procs[-1].proc)
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


def test_the_openai_client_through_the_router(pair):
    c = openai.OpenAI(base_url=pair[-1].url + "/v1", api_key="none", timeout=60, max_retries=0)
    greedy = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    r = c.completions.create(model="tiny", prompt="hello", **greedy)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    chunks = list(c.completions.create(model="tiny", prompt="hello", stream=True,
                                       stream_options={"include_usage": True}, **greedy))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **greedy)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    assert [m.id for m in c.models.list().data] == ["tiny"]
    with pytest.raises(openai.BadRequestError, match="top_p"):       # the engines' validation, before any engine
        c.completions.create(model="tiny", prompt="hello", top_p=7)
    with pytest.raises(openai.NotFoundError, match="nope"):          # the prefill engine's own 404, relayed
        c.completions.create(model="nope", prompt="hello")


def test_the_router_counts_in_its_own_metrics(pair):
    text = httpx.get(pair[-1].url + "/metrics", timeout=10).text
    assert re.search(r'^kvlab_router_engines_alive\{role="decode"\} 2\.0$', text, re.M)
    assert re.search(r'^kvlab_router_requests_total\{outcome="ok"\} [1-9]', text, re.M)


def test_a_client_that_leaves_mid_stream_aborts_the_request_on_the_decode_server(pair):
    decoders = pair[1:3]
    before = sum(aborted(d.url) for d in decoders)
    with httpx.stream("POST", pair[-1].url + "/v1/completions", json=LONG | {"stream": True}, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 15
    while sum(aborted(d.url) for d in decoders) == before:
        assert time.monotonic() < deadline, "the decode server did not abort the request"
        time.sleep(0.2)


def aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^kvlab_requests_aborted_total (\S+)$", text, re.M).group(1))


def test_a_decode_server_killed_mid_stream_fails_only_its_requests(pair):
    """Two streams, one per decode server (round-robin); one server is killed after both started: its stream
    ends with one error event, the other completes, and the next requests go to the survivor."""
    results: list[tuple[int, list[str]]] = [(0, []), (0, [])]
    started = [threading.Event(), threading.Event()]

    def run(i: int) -> None:
        tokens, errors = 0, []
        with httpx.stream("POST", pair[-1].url + "/v1/completions", json=LONG | {"stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                body = json.loads(line[6:]) if line.startswith("data: {") else {}
                tokens += sum(len(c["token_ids"]) for c in body.get("choices", []))
                errors += [body["error"]["message"]] if "error" in body else []
                started[i].set()
        results[i] = (tokens, errors)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for i, t in enumerate(threads):
        t.start()
        assert started[i].wait(60)
    pair[1].kill()
    for t in threads:
        t.join(120)
    broken = [r for r in results if r[1]]
    assert len(broken) == 1 and len(broken[0][1]) == 1 and "decode engine" in broken[0][1][0]
    assert sorted(r[0] for r in results)[1] == LONG["max_tokens"]
    for _ in range(3):
        r = httpx.post(pair[-1].url + "/v1/completions", json=LONG | {"max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text


def test_503_in_the_vllm_shape_while_no_engine_of_a_role_is_alive(pair):
    """A second router in front of one live decode engine (the pair's second: the kill test stops the first) and
    no prefill engine."""
    proxy = ServeProcess("--role", "router", "--prefill", "http://127.0.0.1:9", "--decode", pair[2].url)
    try:
        r = httpx.post(proxy.url + "/v1/completions", json=LONG, timeout=30)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error.keys() == {"message", "type", "param", "code"} and "no prefill engine" in error["message"]
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503
        assert httpx.get(proxy.url + "/v1/models", timeout=10).status_code == 200
    finally:
        assert "Traceback" not in proxy.stop()


@pytest.mark.parametrize("flags", [
    ["--role", "router"],
    ["--role", "router", "--prefill", "http://127.0.0.1:1"],
    ["--role", "router", "--prefill", "ftp://x", "--decode", "http://127.0.0.1:2"],
    ["--role", "router", "--prefill", "http://127.0.0.1:99999", "--decode", "http://127.0.0.1:2"],
    ["--role", "router", "--prefill", "http://h:1/v1", "--decode", "http://127.0.0.1:2"],
    ["--role", "router", "--prefill", "http://h:1", "--decode", "http://h:2", "--backend", "vmm"],
    ["--role", "router", "--prefill", "http://h:1", "--decode", "http://h:2", "--upstream-timeout", "nan"],
    ["--role", "router", "--prefill", "http://h:1", "--decode", "http://h:2", "--upstream-timeout", "0"],
    ["--role", "prefill", "--decode", "http://h:2"],
    ["--upstream-timeout", "5"],
    ["--colocated", "http://h:1"],
    ["--role", "router", "--colocated", "http://h:1", "--decode", "http://h:2"],
    ["--role", "broker"],
])
def test_bad_role_flags_are_one_line_and_exit_2(flags, capsys, monkeypatch):
    monkeypatch.setattr(server, "start_engine", lambda *a: pytest.fail("the engine started"))
    monkeypatch.setattr(server, "serve_router", lambda *a: pytest.fail("the router started"))
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_good_router_flags_reach_the_router(monkeypatch):
    seen = []
    monkeypatch.setattr(server, "serve_router", lambda settings, host, port: seen.append(settings) or 0)
    assert main(["serve", "--role", "router", "--prefill", "http://127.0.0.1:8100/", "http://[::1]:8101",
                 "--decode", "https://d:443", "--upstream-timeout", "7.5"]) == 0
    assert seen[0].engines["prefill"] == ["http://127.0.0.1:8100", "http://[::1]:8101"]
    assert seen[0].engines["decode"] == ["https://d:443"] and seen[0].timeout_s == 7.5
