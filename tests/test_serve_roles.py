"""kvlab serve --role prefill|decode behind --role router, end to end in subprocesses: for every backend the
router's greedy answers (completions and chat, streamed and not) equal one colocated server's, and the handoff is
reported per request (`kvlab.handoff`), summed in /kvlab/stats and counted in /metrics on both roles."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from helpers.servers import ServeProcess, engine, router

from kvlab.experiments.serve.health import wait_healthy
from kvlab.experiments.serve.protocol import ApiError, parse

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("vmm", "paged", "reserve")


class Cluster:
    """One backend's prefill, decode and colocated servers, and the router in front of the first two."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.procs: list[ServeProcess] = []
        try:
            self.prefill = self._add(engine(backend, "prefill"))
            self.decode = self._add(engine(backend, "decode"))
            self.colocated = self._add(engine(backend, "colocated"))
            self.router = self._add(router([self.prefill], [self.decode]))
            wait_healthy(self.router.url, 30, self.router.proc)
        except BaseException:
            self.stop()
            raise

    def _add(self, proc: ServeProcess) -> ServeProcess:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            err = proc.stop()
            assert "Traceback" not in err, err


# A real three-process cluster per backend costs ~18 s to start: vmm's runs by default, paged's and reserve's with
# -m slow (their handoffs stay covered by tests/test_handoff.py in process and tests/test_handoff_processes.py).
@pytest.fixture(scope="module", params=[b if b == "vmm" else pytest.param(b, marks=pytest.mark.slow) for b in BACKENDS])
def cluster(request):
    c = Cluster(request.param)
    yield c
    c.stop()


GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
COMPLETION = GREEDY | {"prompt": "The quick brown fox"}
CHAT = GREEDY | {"messages": [{"role": "user", "content": "Say something about foxes"}]}


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(url: str, path: str, body: dict) -> tuple[list[int], list[dict]]:
    """The token ids a stream carried, and its chunks."""
    chunks = []
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert not any("error" in c for c in chunks), chunks
    return [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]], chunks


def texts(answer: dict) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in answer["choices"]]


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
def test_disaggregated_greedy_answers_equal_a_colocated_server_s(cluster, path, body):
    alone, split = post(cluster.colocated.url, path, body), post(cluster.router.url, path, body)
    assert texts(split) == texts(alone) and split["usage"] == alone["usage"]
    assert split["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert streamed(cluster.router.url, path, body)[0] == alone["choices"][0]["token_ids"]


def test_each_request_reports_its_handoff_and_both_roles_sum_them(cluster):
    decoded = httpx.get(cluster.decode.url + "/kvlab/stats", timeout=10).json()["handoff"]
    # earlier tests' handoffs: the decode side counted each before answering, the prefill side counts once the
    # pull is done, maybe after the answer: settled when it has counted as many
    before = [wait_for_count(cluster.prefill.url, decoded["count"]), decoded]
    answer = post(cluster.router.url, "/v1/completions", COMPLETION)
    handoff = answer["kvlab"]["handoff"]
    assert handoff.keys() == {"seconds", "bytes_copied", "units_moved", "unit"} and handoff["units_moved"] > 0
    assert (handoff["bytes_copied"] == 0) == (cluster.backend == "vmm")   # vmm remaps, never copies
    assert post(cluster.colocated.url, "/v1/completions", COMPLETION)["kvlab"]["handoff"] is None
    for proc, old in zip((cluster.prefill, cluster.decode), before):
        stats = wait_for_count(proc.url, old["count"] + 1)
        assert stats["bytes_copied"] - old["bytes_copied"] == handoff["bytes_copied"]
        assert stats["units_moved"] - old["units_moved"] == handoff["units_moved"]
        metrics = httpx.get(proc.url + "/metrics", timeout=10).text
        assert float(re.search(r"^kvlab_handoffs_total (\S+)$", metrics, re.M).group(1)) == stats["count"]


def wait_for_count(url: str, count: int, timeout: float = 10) -> dict:
    """The server's handoff totals once they count `count` (the prefill side counts when the pull is done)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/kvlab/stats", timeout=10).json()["handoff"]
        if stats["count"] >= count or time.monotonic() > deadline:
            assert stats["count"] == count, stats
            return stats
        time.sleep(0.1)


def test_the_protocol_by_hand_prefill_then_decode_and_colocated_refuses_the_field(cluster):
    """The router's two calls made by hand: the prefill answer's kv_transfer_params, given to the decode server,
    give the colocated answer; a colocated server refuses the field in one line."""
    answer = post(cluster.prefill.url, "/v1/completions",
                  COMPLETION | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and len(params["first_token_ids"]) == 1
    assert answer["usage"]["completion_tokens"] == 1
    r = httpx.post(cluster.colocated.url + "/v1/completions", json=COMPLETION | {"kv_transfer_params": params},
                   timeout=30)
    assert r.status_code == 400 and "\n" not in r.json()["error"]["message"]
    decoded = post(cluster.decode.url, "/v1/completions", COMPLETION | {"kv_transfer_params": params})
    assert decoded["choices"][0]["token_ids"] == post(cluster.colocated.url, "/v1/completions",
                                                      COMPLETION)["choices"][0]["token_ids"]


@pytest.mark.parametrize("value,message", [
    ([1], "must be an object"),
    ("do_remote_decode", "must be an object"),
    ({"do_remote_decode": 1}, "do_remote_decode must be true or false"),
    ({"num_tokens": True}, "num_tokens must be an integer"),
    ({"pool": 3}, "pool must be a string or null"),
    ({"first_token_ids": [-1]}, "first_token_ids must be token ids"),
    ({"first_token_ids": [1.5]}, "first_token_ids must be token ids"),
    ({"handoff_id": "x" * 5000}, "at most 4,096 characters"),
])
def test_kv_transfer_params_of_the_wrong_shape_are_one_line_400s(value, message):
    with pytest.raises(ApiError) as e:
        parse({"prompt": "hi", "kv_transfer_params": value}, False, None)
    assert e.value.status == 400 and e.value.param == "kv_transfer_params" and message in e.value.message
    assert "\n" not in e.value.message


def test_kv_transfer_params_pass_through_as_given():
    params = {"do_remote_prefill": True, "handoff_id": "ab", "address": "x", "num_tokens": 3,
              "first_token_ids": [7], "backend": "vmm", "pool": None, "model": "tiny"}
    assert parse({"prompt": "hi", "kv_transfer_params": params}, False, None).kv_transfer_params == params
    assert parse({"prompt": "hi", "kv_transfer_params": None}, False, None).kv_transfer_params is None
