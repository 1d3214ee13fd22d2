"""Issue 37's serving cases, in one process: prefill, decode and colocated engines (paged, engine threads) and the
router in front of the first two. The router's first-token logprob is the engine's; /detokenize refuses ids
outside the vocabulary; an upstream's 200 that is not JSON is a 502; /kvlab/stats is complete from the first poll
and an idle prefill engine's used_units drops once its kept KV expires; every failed pull is a one-line 409 or
502, relayed as such by the router; JSON integers beyond a float are 400s; errors echo a short prefix."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response
from helpers.servers import Served

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.handoff.wire import PREFIX, socket_address
from kvlab.experiments.serve.app import Server, create_app
from kvlab.experiments.serve.handles import ThreadEngine
from kvlab.experiments.serve.prom import ServerMetrics
from kvlab.experiments.serve.protocol import ApiError, detokenize_request, parse, tokenize_request
from kvlab.experiments.serve.router import Router, RouterSettings, create_router_app

PAGED = {"backend": "paged"}
PROMPT = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}


class LiveServer(Served):
    """A tiny-model engine (`config` over the paged backend) stepping in a thread, behind kvlab's app."""

    def __init__(self, config: dict) -> None:
        self.engine = ThreadEngine(Engine.from_config(make_config(model="tiny", **config)), ServerMetrics("paged"),
                                   1024)
        self.engine.start()
        super().__init__(create_app(Server(self.engine, "tiny")))

    def stop(self) -> None:
        super().stop()
        self.engine.stop()


def routed(engines: dict[str, list[str]]) -> Served:
    served = Served(create_router_app(Router(RouterSettings(engines, 30.0))))
    deadline = time.monotonic() + 20
    while httpx.get(served.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the router saw no live engine"
        time.sleep(0.1)
    return served


@pytest.fixture(scope="module")
def trio():
    started: list = []
    try:
        for role in ("prefill", "decode", "colocated"):
            started.append(LiveServer(PAGED | {"kv_role": role, "handoff_timeout_s": 20.0}))
        started.append(routed({"prefill": [started[0].url], "decode": [started[1].url]}))
        yield started
    finally:
        for s in reversed(started):
            s.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def one_line_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert "\n" not in message and len(message) < 400, message
    return message


# -- wrong answers ---------------------------------------------------------------------------------------------
def test_the_first_token_s_logprob_through_the_router_is_the_colocated_one(trio):
    prefill, decode, colocated, router = trio
    body = PROMPT | {"logprobs": 3}
    alone = post(colocated.url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    split = post(router.url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert split["tokens"] == alone["tokens"]
    assert split["token_logprobs"] == pytest.approx(alone["token_logprobs"], abs=1e-4)
    assert split["token_logprobs"][0] < 0.0
    assert [t.keys() for t in split["top_logprobs"]] == [t.keys() for t in alone["top_logprobs"]]
    assert split["top_logprobs"][0] == pytest.approx(alone["top_logprobs"][0], abs=1e-4)


def test_the_first_token_s_chat_logprob_through_the_router_is_the_colocated_one(trio):
    prefill, decode, colocated, router = trio
    body = CHAT | {"logprobs": True, "top_logprobs": 2}
    alone = post(colocated.url, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    split = post(router.url, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in split] == [e["token"] for e in alone]
    assert split[0]["logprob"] == pytest.approx(alone[0]["logprob"], abs=1e-4) and split[0]["logprob"] < 0
    assert len(split[0]["top_logprobs"]) == 2
    assert [t["token"] for t in split[0]["top_logprobs"]] == [t["token"] for t in alone[0]["top_logprobs"]]


def test_a_decode_request_asking_more_top_logprobs_than_the_prefill_computed_is_a_400(trio):
    prefill, decode, _, _ = trio
    params = post(prefill.url, "/v1/completions", PROMPT | {"logprobs": 1, "kv_transfer_params":
                                                              {"do_remote_decode": True}}).json()["kv_transfer_params"]
    r = post(decode.url, "/v1/completions", PROMPT | {"logprobs": 4, "kv_transfer_params": params})
    assert "logprobs" in one_line_error(r, 400)


@pytest.mark.parametrize("tokens", [[1259], [2**31], [2**63], [10**30]])
def test_detokenize_refuses_ids_outside_the_vocabulary_as_completions_does(trio, tokens):
    colocated = trio[2]
    assert "vocabulary" in one_line_error(post(colocated.url, "/detokenize", {"tokens": tokens}), 400)
    assert post(colocated.url, "/v1/completions", {"prompt": tokens}).status_code == 400
    assert post(colocated.url, "/detokenize", {"tokens": [72, 105]}).status_code == 200


def stub_app(answer: bytes, status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def completions() -> Response:
        return Response(answer, status_code=status, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return Response(answer, status_code=status, media_type="application/json")
    return app


@pytest.mark.parametrize("answer", [b"this is not json", b"", b"[1, 2]", b'{"id": 1'])
def test_an_upstream_200_that_is_not_a_json_object_is_a_502(answer):
    stub = Served(stub_app(answer))
    router = routed({"colocated": [stub.url]})
    try:
        assert "not a JSON" in one_line_error(post(router.url, "/v1/completions", PROMPT), 502)
        assert "not a JSON" in one_line_error(post(router.url, "/v1/chat/completions", CHAT), 502)
        assert "not an event stream" in one_line_error(post(router.url, "/v1/completions", PROMPT | {"stream": True}),
                                                       502)
    finally:
        router.stop()
        stub.stop()


def test_kvlab_stats_is_complete_from_the_first_poll():
    fresh = LiveServer(PAGED)
    try:
        before = httpx.get(fresh.url + "/kvlab/stats", timeout=10).json()
        post(fresh.url, "/v1/completions", PROMPT)
        after = httpx.get(fresh.url + "/kvlab/stats", timeout=10).json()
    finally:
        fresh.stop()
    assert before.keys() == after.keys() and before["used_units"] == 0 and before["total_units"] > 0


def test_an_idle_prefill_engine_s_used_units_drop_once_its_kept_kv_expires():
    prefill = LiveServer(PAGED | {"kv_role": "prefill", "handoff_timeout_s": 0.5})
    try:
        r = post(prefill.url, "/v1/completions", PROMPT | {"kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200
        held = httpx.get(prefill.url + "/kvlab/stats", timeout=10).json()
        deadline = time.monotonic() + 10
        while (stats := httpx.get(prefill.url + "/kvlab/stats", timeout=10).json())["handoff"]["expired"] < 1:
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        time.sleep(0.3)
        stats = httpx.get(prefill.url + "/kvlab/stats", timeout=10).json()
    finally:
        prefill.stop()
    assert held["used_units"] > 0 and stats["used_units"] == 0 and stats["kv_usage_ratio"] == 0.0


# -- failed pulls ----------------------------------------------------------------------------------------------
def prefilled(trio) -> dict:
    r = post(trio[0].url, "/v1/completions", PROMPT | {"kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_a_replayed_handoff_is_a_one_line_409(trio):
    params = prefilled(trio)
    assert post(trio[1].url, "/v1/completions", PROMPT | {"kv_transfer_params": params}).status_code == 200
    one_line_error(post(trio[1].url, "/v1/completions", PROMPT | {"kv_transfer_params": params}), 409)
    r = httpx.post(trio[1].url + "/v1/completions", json=PROMPT | {"kv_transfer_params": params, "stream": True},
                   timeout=60)
    assert r.status_code == 200 and '"code": "409"' in r.text       # streamed: the error event names the status


def test_a_wrong_handoff_id_is_a_one_line_409(trio):
    params = prefilled(trio) | {"handoff_id": "0" * 32}
    one_line_error(post(trio[1].url, "/v1/completions", PROMPT | {"kv_transfer_params": params}), 409)


def test_a_handoff_from_another_backend_is_a_one_line_400(trio):
    params = prefilled(trio) | {"backend": "vmm"}
    one_line_error(post(trio[1].url, "/v1/completions", PROMPT | {"kv_transfer_params": params}), 400)


def test_an_unreachable_prefill_engine_is_a_one_line_502(trio):
    params = prefilled(trio) | {"address": PREFIX + "nobody-listens-here"}
    one_line_error(post(trio[1].url, "/v1/completions", PROMPT | {"kv_transfer_params": params}), 502)


def framed(body: bytes) -> bytes:
    return len(body).to_bytes(8, "little") + body


@pytest.mark.parametrize("answer", [framed(b"hello"), framed(b"{}"), framed(b"[1, 2]"), framed(b'{"ok": true}'),
                                    b"\xff" * 8, b""])
def test_a_malformed_answer_from_the_prefill_side_is_a_one_line_502(trio, answer):
    address = PREFIX + f"fake-{time.monotonic_ns()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_address(address))
    listener.listen(4)

    def answer_once() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            conn.recv(65536)
            conn.sendall(answer)
            time.sleep(0.5)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    try:
        params = prefilled(trio) | {"address": address}
        r = post(trio[1].url, "/v1/completions", PROMPT | {"kv_transfer_params": params})
        assert one_line_error(r, 502)
    finally:
        thread.join(10)
        listener.close()


def test_the_router_relays_a_decode_engine_s_409_and_502_not_a_500():
    for status in (409, 502):
        body = json.dumps(ApiError(status, "the pull failed", kind="conflict").body()).encode()
        prefill = Served(stub_app(json.dumps({"kv_transfer_params": {"handoff_id": "x"}}).encode()))
        decode = Served(stub_app(body, status))
        router = routed({"prefill": [prefill.url], "decode": [decode.url]})
        try:
            assert one_line_error(post(router.url, "/v1/completions", PROMPT), status) == "the pull failed"
        finally:
            for s in (router, decode, prefill):
                s.stop()


# -- 400s, not 500s; short echoes -------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [10**400, -(10**400)], ids=["1e400", "-1e400"])
def test_json_integers_beyond_a_float_are_400s(field, value):
    body = json.loads(f'{{"prompt": "hi", "{field}": {value}}}')
    with pytest.raises(ApiError) as e:
        parse(body, False, lambda messages: "x")
    assert e.value.status == 400 and e.value.param == field and len(e.value.message) < 200


HUGE = "x" * 4_000_000
ECHOED = [
    ({"stream": HUGE}, False), ({"echo": HUGE}, False), ({"user": [HUGE]}, False),
    ({"logit_bias": {HUGE: 1}}, False), ({"messages": [{"role": HUGE}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": HUGE}]}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": [HUGE]}]}]}, True),
    ({"model": [HUGE]}, False), ({"stream_options": [HUGE]}, False), ({"temperature": HUGE}, False),
]


@pytest.mark.parametrize("extra, chat", ECHOED, ids=[str(i) for i in range(len(ECHOED))])
def test_a_400_echoes_at_most_a_short_prefix_of_the_bad_value(extra, chat):
    with pytest.raises(ApiError) as e:
        parse({"prompt": "hi"} | extra, chat, lambda messages: "x")
    assert e.value.status == 400 and len(e.value.message) < 300, len(e.value.message)


@pytest.mark.parametrize("call", [lambda: tokenize_request({"prompt": [HUGE]}, None, None),
                                  lambda: detokenize_request({"tokens": [HUGE]}, 300),
                                  lambda: detokenize_request({"tokens": HUGE}, 300)])
def test_tokenize_and_detokenize_echo_a_short_prefix(call):
    with pytest.raises(ApiError) as e:
        call()
    assert e.value.status == 400 and len(e.value.message) < 300
