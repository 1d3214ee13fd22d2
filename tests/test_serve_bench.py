"""kvlab bench serve: arrivals, metric definitions, the client's timing against a stub server, the sweep."""
from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvlab.common.errors import ConfigError
from kvlab.experiments.cli import main as cli
from kvlab.experiments.loadgen.arrivals import arrival_times, intervals
from kvlab.experiments.loadgen.client import run_load
from kvlab.experiments.loadgen.datasets import LoadRequest, build
from kvlab.experiments.loadgen.latency import RequestRecord, parse_goodput, summarize


@pytest.mark.parametrize("rate,burstiness", [(4.0, 1.0), (10.0, 0.5), (2.0, 4.0)])
def test_gamma_arrivals_mean_and_cv(rate, burstiness):
    gaps = intervals(100_000, rate, burstiness, np.random.default_rng(1))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.02)


def test_infinite_rate_and_bad_values():
    assert not arrival_times(5, math.inf).any()
    assert (arrival_times(50, 3.0, 1.0, seed=4) == arrival_times(50, 3.0, 1.0, seed=4)).all()
    with pytest.raises(ConfigError):
        intervals(3, 0.0, 1.0, np.random.default_rng())
    with pytest.raises(ConfigError):
        intervals(3, 1.0, -1.0, np.random.default_rng())


def test_percentiles_and_goodput_hand_computed():
    # ttft 100/200/300/400 ms; e2el = ttft + (n-1) * 50 ms with n = 3 output tokens -> tpot 50 ms each,
    # except the last request (tpot 100 ms); one failed request counts only in `failed`.
    recs = [RequestRecord(True, 10, 3, t, [0.05, 0.05], t + 0.1) for t in (0.1, 0.2, 0.3)]
    recs.append(RequestRecord(True, 10, 3, 0.4, [0.1, 0.1], 0.6))
    recs.append(RequestRecord(False, 10, 0, error="boom"))
    r = summarize(recs, duration=2.0, slos=parse_goodput(["ttft:250", "tpot:60"]), percentiles=(50, 99))
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (4, 1, 12)
    assert r["request_throughput"] == pytest.approx(2.0) and r["output_throughput"] == pytest.approx(6.0)
    assert r["total_token_throughput"] == pytest.approx(26.0)
    assert r["mean_ttft_ms"] == pytest.approx(250) and r["median_ttft_ms"] == pytest.approx(250)
    assert r["p99_ttft_ms"] == pytest.approx(397)               # 300 + 0.97 * 100 (linear interpolation)
    assert r["std_ttft_ms"] == pytest.approx(math.sqrt(12500))
    assert r["mean_tpot_ms"] == pytest.approx(62.5) and r["p50_tpot_ms"] == pytest.approx(50)
    assert r["mean_itl_ms"] == pytest.approx(62.5) and r["p99_itl_ms"] == pytest.approx(100)
    assert r["mean_e2el_ms"] == pytest.approx(375)
    assert r["request_goodput"] == pytest.approx(1.0)           # 100 and 200 ms TTFT with 50 ms TPOT: 2 / 2 s
    assert r["max_output_tokens_per_s"] == 12                  # all started at 0 s, every token within the 1st s
    with pytest.raises(ConfigError):
        parse_goodput(["latency:5"])


def test_datasets_are_seeded(tmp_path):
    a, b = build("seed", 20, 3, 259), build("seed", 20, 3, 259)
    assert [x.prompt for x in a] == [x.prompt for x in b] and all(3 <= t < 259 for x in a for t in x.prompt)
    rnd = build("random", 10, 0, 259, input_len=8, output_len=4)
    assert {len(x.prompt) for x in rnd} == {8} and {x.output_len for x in rnd} == {4}
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 1000 + 500 * i, "input_length": 5, "output_length": 2,
                                           "hash_ids": [i]}) for i in range(3)))
    assert [x.timestamp for x in build(f"trace:{trace}", 10, 0, 259)] == [0.0, 0.5, 1.0]
    with pytest.raises(ConfigError):
        build("zipf", 3, 0, 259)


FIRST_S, GAP_S, TOKENS = 0.060, 0.025, 5
STAMPS: dict[int, list[float]] = {}      # prompt's first id -> [received, chunk 0 sent, chunk 1 sent, ...]
BODIES: list[dict] = []                  # every completion request's body, as received


def stub_app() -> FastAPI:
    """Fixed delays; it also stamps when it really sent each chunk (a loaded machine oversleeps), so the test
    checks what the client measured against what the server did."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        BODIES.append(body)
        stamps = STAMPS.setdefault(body["prompt"][0], [time.perf_counter()])

        async def events():
            await asyncio.sleep(FIRST_S)
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(GAP_S)
                stamps.append(time.perf_counter())
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': TOKENS}})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(stub_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_client_measures_known_delays(stub):
    reqs = [LoadRequest([1000 + i], TOKENS) for i in range(6)]
    records, duration, peak = asyncio.run(run_load(stub, reqs, arrival_times(6, 20.0, 1.0, seed=0).tolist()))
    assert all(r.success and r.output_tokens == TOKENS for r in records)
    stamps = [STAMPS[1000 + i] for i in range(6)]
    assert all(s[1] - s[0] >= FIRST_S and min(np.diff(s[1:])) >= GAP_S for s in stamps)   # the delays happened
    ttft_err = np.median([r.ttft - (s[1] - s[0]) for r, s in zip(records, stamps)])
    itl_err = np.median([a - b for r, s in zip(records, stamps) for a, b in zip(r.itl, np.diff(s[1:]))])
    # TTFT also holds the TCP connect and the request upload, which the stub cannot stamp: a looser bound
    assert 0 <= ttft_err < 0.020 and abs(itl_err) < 0.003, (ttft_err, itl_err)
    # the TTFT is the first chunk's delay as the server really kept it (FIRST_S asked; a loaded machine oversleeps)
    kept = np.median([s[1] - s[0] for s in stamps])
    assert np.median([r.ttft for r in records]) == pytest.approx(kept, abs=0.030)
    assert 1 <= peak <= 6


def test_max_concurrency_caps_in_flight(stub):
    reqs = [LoadRequest([5], TOKENS) for _ in range(6)]
    _, _, peak = asyncio.run(run_load(stub, reqs, [0.0] * 6, max_concurrency=2))
    assert peak == 2


def test_bench_serve_cli_against_stub(stub, tmp_path, capsys):
    rc = cli.main(["bench", "serve", "--base-url", stub, "--num-prompts", "4", "--dataset", "random",
                   "--input-len", "4", "--output-len", "5", "--goodput", "ttft:1000", "--save-result",
                   "--result-dir", str(tmp_path)])
    assert rc == 0
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["completed"] == 4 and saved["request_goodput"] > 0 and "p99_itl_ms" in saved
    from helpers.provenance_check import check_provenance
    assert check_provenance(saved["provenance"], "bench serve")["base_url"] == stub
    assert re.search(r"completed\s+4", capsys.readouterr().out)


@pytest.mark.parametrize("extra,prompt_type", [([], str), (["--token-ids"], list)])
def test_prompts_are_text_unless_token_ids_are_asked_for(stub, capsys, extra, prompt_type):
    """vLLM sends text; --host/--port build the URL as vLLM does; the random dataset sends ignore_eos."""
    host, port = stub.removeprefix("http://").split(":")
    BODIES.clear()
    rc = cli.main(["bench", "serve", "--host", host, "--port", port, "--num-prompts", "3", "--random-input-len", "6",
                   "--random-output-len", "5", "--tokenizer", "tiny", *extra])
    out = capsys.readouterr().out
    assert rc == 0 and f"-> {stub}/v1/completions (openai, model stub)" in out
    assert len(BODIES) == 3 and all(isinstance(b["prompt"], prompt_type) and b["ignore_eos"] for b in BODIES)
    assert all(len(b["prompt"]) == 6 and b["max_tokens"] == 5 for b in BODIES)


def test_a_server_without_v1_models_is_one_line_unless_model_is_given(stub, capsys):
    """Another server's /v1/models that is absent or odd: one line that says to pass --model, exit 2."""
    rc = cli.main(["bench", "serve", "--base-url", stub + "/nowhere", "--num-prompts", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "/nowhere/v1/models" in err and "pass --model" in err


def test_paired_sweep_writes_results(tmp_path):
    rc = cli.main(["bench", "serve", "--backends", "vmm,paged", "--request-rates", "inf", "--num-prompts", "4",
                   "--dataset", "random", "--input-len", "8", "--output-len", "32", "--repeats", "1",
                   "--out", str(tmp_path)])
    assert rc == 0
    runs = json.loads((tmp_path / "serve.json").read_text())["runs"]
    assert [(r["backend"], r["completed"]) for r in runs] == [("vmm", 4), ("paged", 4)]
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and not re.search(r"(src|href)=[\"']https?:", page)
    assert (tmp_path / "serve.csv").read_text().count("\n") == 3
    for r in runs:                     # per-request KV attribution from the server, and the sampled time series
        assert len(r["requests"]) == 4 and all(q["kv_wait_s"] is not None for q in r["requests"])
        assert r["total_recomputed_tokens"] == 0 and r["total_kv_wait_s"] >= 0
        assert r["timeline"]["t"] and len(r["timeline"]["running"]) == len(r["timeline"]["t"])
    assert {p.name for p in tmp_path.glob("serve_timeline_*.png")} == {"serve_timeline_vmm.png",
                                                                        "serve_timeline_paged.png"}
    assert (tmp_path / "serve_requests.csv").read_text().count("\n") == 9
    from helpers.provenance_check import read_back
    config = read_back(tmp_path, "serve.json", "bench serve")
    assert {b: e["backend"] for b, e in config["engine"].items()} == {"vmm": "vmm", "paged": "paged"}
    assert config["engine"]["paged"]["model"] == "tiny" and "paged" in config["engine"]["paged"]
    assert "configuration</summary>" in page and "kv_cache_bytes" in page
