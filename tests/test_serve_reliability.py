"""Issue 28, the server: a hostile client gets a 4xx, costs the other clients nothing and leaks nothing; a bad
`kvlab serve` flag is one line and exit 2; an engine's death is named to the log and to the clients."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from helpers.servers import LiveServer, wait_for
from hypothesis import assume, given
from hypothesis import strategies as st

from kvlab.common.tokenizer import ByteTokenizer
from kvlab.experiments.cli.main import main
from kvlab.experiments.limits import MAX_BODY_BYTES, MAX_N, MAX_STOP_CHARS
from kvlab.experiments.serve import server
from kvlab.experiments.serve.decoding import Decoding
from kvlab.experiments.serve.stop_scan import StopScan, borders

BUSY = {"model": "tiny", "prompt": "busy", "max_tokens": 1000, "ignore_eos": True, "n": 4}


@pytest.fixture(scope="module")
def live():
    s = LiveServer()
    yield s
    s.stop()


def post(live, body: dict | str, **kw) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(live.url + "/v1/completions", content=content, timeout=30,
                      headers={"content-type": "application/json"}, **kw)


def is_openai_error(r: httpx.Response, status: int) -> bool:
    err = r.json()["error"]
    return r.status_code == status and isinstance(err["message"], str) and err["code"] == str(status)


# -- the stop-string hold-back ------------------------------------------------------------------------------------
@given(st.lists(st.text("ab", max_size=5), max_size=4), st.text("ab", min_size=1, max_size=6))
def test_the_scan_holds_back_the_longest_end_that_starts_the_stop(pieces, stop):
    text = "".join(pieces)
    assume(stop not in text)                     # a whole match is cut before the hold-back is asked
    scan = StopScan(stop, borders(stop))
    for piece in pieces:                         # fed as tokens arrive
        scan.feed(piece)
    old = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)   # the quadratic original
    assert scan.held() == old


def test_a_stop_string_at_the_limit_is_held_back_then_cut_or_released():
    tok = ByteTokenizer(1024, add_bos=False)
    start = "q" * (MAX_STOP_CHARS - 1)
    dec = Decoding(tok, 2, [start + "!"])
    assert dec.add(0, tok.encode("a" + start))[1] == "a" and dec.add(1, tok.encode("a" + start))[1] == "a"
    assert dec.add(0, tok.encode("!"))[1] == "" and dec.samples[0].finish_reason == "stop"
    assert dec.add(1, tok.encode("x"))[1] == start + "x" and dec.samples[1].finish_reason is None


def test_a_1mb_stop_string_is_refused_and_costs_health_nothing(live):
    answer: list[httpx.Response] = []
    hostile = threading.Thread(target=lambda: answer.append(
        post(live, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": "q" * 1_000_000})))
    hostile.start()
    slowest = 0.0
    while hostile.is_alive():
        t0 = time.monotonic()
        assert httpx.get(live.url + "/health", timeout=30).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
    hostile.join()
    assert is_openai_error(answer[0], 400) and "stop" in answer[0].json()["error"]["message"]
    assert slowest < 1.0                       # was 28.8 s, while the hold-back ran on the event loop for 62 s


def test_a_long_stop_string_within_the_limit_answers(live):
    r = post(live, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": ["q" * MAX_STOP_CHARS]})
    assert r.status_code == 200, r.text


# -- disconnects ----------------------------------------------------------------------------------------------------
def raw_request(live, body: bytes, declared: int | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])), timeout=30)
    length = len(body) if declared is None else declared
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % length + body)
    return sock


def test_a_non_streamed_request_whose_client_leaves_is_aborted_within_a_second(live):
    aborted = live.metric("kvlab_requests_aborted_total")
    sock = raw_request(live, json.dumps(BUSY).encode())
    assert wait_for(lambda: live.metric("kvlab_kv_units_used") > 0)
    sock.close()
    left = time.monotonic()
    assert wait_for(lambda: live.metric("kvlab_requests_aborted_total") == aborted + 1, 1.0)
    assert wait_for(lambda: live.metric("kvlab_kv_units_used") == 0, 1.0)
    assert time.monotonic() - left < 1.0


def test_a_client_that_leaves_while_sending_its_body_logs_no_traceback(live, capfd):
    raw_request(live, b'{"prompt": "h', declared=1000).close()
    time.sleep(0.5)
    assert post(live, {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert "Traceback" not in capfd.readouterr().err


# -- the body limit ---------------------------------------------------------------------------------------------------
def test_a_declared_oversized_body_is_413_before_it_is_sent(live):
    sock = raw_request(live, b"", declared=100 * 2**20)              # 100 MB announced, not a byte sent
    sock.settimeout(5)
    answer = b"".join(iter(lambda: sock.recv(65536), b"")).decode()        # the server closes the connection
    sock.close()
    assert answer.startswith("HTTP/1.1 413") and "larger than the limit" in answer


def test_a_chunked_oversized_body_is_413_while_it_streams(live):
    """No Content-Length: 1 MiB chunks until the limit is passed, then the client waits without ending the body.
    Before the limit, the server read on until the body ended (21 s and 2 GB of RSS for 100 MB)."""
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            sock.sendall(b"100000\r\n" + b" " * 2**20 + b"\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


# -- 500s that were 400s ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a\ud800b"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}),
], ids=["prompt", "chat"])
def test_a_lone_surrogate_is_400(live, path, body):
    r = httpx.post(live.url + path, content=json.dumps(body | {"max_tokens": 2}), timeout=30)
    assert is_openai_error(r, 400), r.text


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"prompt": ' + "[" * 50_000 + "]" * 50_000 + "}"],
                         ids=["array", "in-a-field"])
def test_deeply_nested_json_is_400(live, text):
    assert is_openai_error(post(live, text), 400)


@pytest.mark.parametrize("body", [{"n": MAX_N + 1}, {"max_tokens": 2**40}, {"prompt": "x" * (9 * 2**20)},
                                  {"top_k": 2**63}, {"seed": -1}, {"seed": 2**64 - 1}],
                         ids=["n", "max_tokens", "prompt", "top_k", "seed-1", "seed-2**64"])
def test_request_sizes_beyond_the_limits_are_400(live, body):
    """top_k 2**63 (found by the fuzzer) overflowed the sampler's int64 tensor and stopped the engine loop."""
    assert is_openai_error(post(live, {"prompt": "hi"} | body), 400)
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


# -- kvlab serve's own flags -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--port", "-1"], ["--port", "70000"], ["--max-waiting", "0"],
                                   ["--max-waiting", "-1"]])
def test_bad_serve_flags_are_one_line_and_exit_2(flags, capsys, monkeypatch):
    def no_engine(*args):
        raise AssertionError("the flags are checked before the engine starts")    # (before: a server started)
    monkeypatch.setattr(server, "start_engine", no_engine)
    assert main(["serve", "--model", "tiny", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and flags[0] in err


# -- the engine's death -----------------------------------------------------------------------------------------------
def test_the_engine_s_death_is_named_to_the_log_and_to_clients(caplog):
    s = LiveServer(engine="process")
    try:
        os.kill(s.engine.proc.pid, signal.SIGKILL)
        assert wait_for(lambda: httpx.get(s.url + "/health", timeout=5).status_code == 503)
        told = post(s, {"prompt": "hi", "max_tokens": 2}).json()["error"]["message"]
        health = httpx.get(s.url + "/health", timeout=5).json()["error"]["message"]
    finally:
        s.stop()
    assert "killed by signal SIGKILL" in told and "killed by signal SIGKILL" in health
    assert "the engine process was killed by signal SIGKILL; failing every request" in caplog.text
