"""Issue 28's load-generator cases: every bad flag is one line on stderr, exit 2, nothing on stdout, before any
work (no connection, no server started); servers that close, never answer or never stop streaming end in
bounded time with the request failed, never a hang or a traceback."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from helpers.servers import serve_in_thread

from kvlab.experiments.cli import main as cli

UNUSED_URL = "http://127.0.0.1:9"          # the discard port: a case that connects fails, not hangs

BAD_FLAGS = {
    "not a url": (["--base-url", "notaurl"], "--base-url 'notaurl': give an http:// or https:// URL"),
    "ftp": (["--base-url", "ftp://example.com/x"], "--base-url 'ftp://example.com/x': give an http://"),
    "bracket": (["--base-url", "http://[::1"], "--base-url 'http://[::1': not a URL"),
    "port 99999": (["--base-url", "http://127.0.0.1:99999"], "--base-url 'http://127.0.0.1:99999': not a URL"),
    "--port 70000": (["--port", "70000"], "--port must be an integer in [1, 65,535]"),
    "0 prompts": (["--num-prompts", "0"], "--num-prompts must be an integer in [1, 1,000,000]"),
    "-1 prompts": (["--num-prompts", "-1"], "--num-prompts must be an integer in [1, 1,000,000]"),
    "1e12 prompts": (["--num-prompts", "1000000000000"], "--num-prompts must be an integer in [1, 1,000,000]"),
    "too many tokens": (["--num-prompts", "1000000"], "--num-prompts x prompt length reach 1,024,000,000 tokens"),
    "concurrency -1": (["--max-concurrency", "-1"], "--max-concurrency must be an integer in [1, 1,000,000]"),
    "range nan": (["--range-ratio", "nan"], "--random-range-ratio must be a finite number in [0, 1]"),
    "range -3": (["--random-range-ratio", "-3"], "--random-range-ratio must be a finite number in [0, 1]"),
    "range 1": (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1), got 1"),
    "scale nan": (["--scale", "nan"], "--scale must be a finite number > 0 and <= 1024"),
    "scale 1e9": (["--scale", "1e9"], "--scale must be a finite number > 0 and <= 1024"),
    "vocab 3": (["--vocab-size", "3", "--token-ids"], "--vocab-size must be an integer in [4, 16,777,216]"),
    "vocab 0": (["--vocab-size", "0"], "--vocab-size must be an integer in [4, 16,777,216]"),
    "seed -1": (["--seed", "-1"], "--seed must be an integer in [0, 9,223,372,036,854,775,807]"),
    "rate 1e-300": (["--request-rate", "1e-300"], "--request-rate 1e-300 sends 1,000 prompts over 1e+303 s"),
    "rate 0": (["--request-rate", "0"], "--request-rate must be a finite number > 0 requests/s (or inf)"),
    "rate nan": (["--request-rate", "nan"], "--request-rate must be a finite number > 0 requests/s (or inf)"),
    "burstiness 1e-300": (["--burstiness", "1e-300"], "--burstiness must be a finite number in [0.01, 100]"),
    "read timeout 0": (["--read-timeout", "0"], "--read-timeout must be a finite number > 0 and <= 604800 s"),
    "metric": (["--percentile-metrics", "ttft,foo"], "unknown --percentile-metrics 'foo'"),
    "percentile": (["--metric-percentiles", "101"], "each --metric-percentiles value must be a finite number > 0"),
    "percentile text": (["--metric-percentiles", "p99"], "each --metric-percentiles value must be a finite number"),
    "goodput": (["--goodput", "ttft:-5"], "bad --goodput 'ttft:-5': the target must be a finite number of ms > 0"),
    "endpoint": (["--endpoint", "v1/completions", "--model", "m"], "--endpoint 'v1/completions': a path such as"),
    "dataset": (["--dataset-name", "zipf"], "unknown --dataset-name 'zipf'"),
    "sharegpt without file": (["--dataset-name", "sharegpt"], "--dataset-name sharegpt reads a file"),
    "server args": (["--backends", "vmm", "--server-args", '"oops'], "--server-args '\"oops': No closing quotation"),
    "unknown backend": (["--backends", "vmm,foo"], "unknown backend 'foo' in --backends; choose from: "),
    "sweep rate": (["--backends", "vmm", "--request-rates", "1,1e-300"], "--request-rate 1e-300 sends"),
}


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(["bench", "serve", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_line(rc: int, out: str, err: str, expected: str) -> None:
    assert (rc, out) == (2, ""), (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_a_bad_flag_is_one_line_before_any_work(case, capsys):
    argv, expected = BAD_FLAGS[case]
    base = [] if "--base-url" in argv or "--backends" in argv or "--port" in argv else ["--base-url", UNUSED_URL]
    t0 = time.monotonic()
    assert_one_line(*run_cli(base + argv, capsys), expected)
    assert time.monotonic() - t0 < 10          # `--backends vmm,foo` starts no vmm server first


def write_trace(tmp_path, **fields) -> str:
    row = {"timestamp": 0, "input_length": 4, "output_length": 2} | fields
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"timestamp": 5, "input_length": 4, "output_length": 2}))
    return str(path)


@pytest.mark.parametrize("fields,expected", [({"input_length": 10**12}, "input_length"),
                                             ({"timestamp": float("nan")}, "timestamp")])
def test_a_bad_trace_row_is_one_line(tmp_path, capsys, fields, expected):
    path = write_trace(tmp_path, **fields)
    rc, out, err = run_cli(["--base-url", UNUSED_URL, "--model", "m", "--dataset-name", "trace", "--dataset-path",
                            path], capsys)
    assert_one_line(rc, out, err, expected)


@contextmanager
def raw_server(handle):
    """A TCP server on loopback that hands each connection to `handle(conn)` in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    stop = threading.Event()

    def serve():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            threading.Thread(target=handle, args=(conn, stop), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def close_at_once(conn, stop):
    conn.close()


def never_answer(conn, stop):
    stop.wait(30)
    conn.close()


SMALL = ["--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "4", "--disable-tqdm"]


@pytest.mark.parametrize("handle", [close_at_once, never_answer])
def test_a_server_that_closes_or_never_answers_fails_the_requests(handle, capsys):
    with raw_server(handle) as url:
        t0 = time.monotonic()
        rc, out, err = run_cli(["--base-url", url, "--model", "m", "--read-timeout", "0.5", *SMALL], capsys)
    assert time.monotonic() - t0 < 15
    assert rc == 1 and "Traceback" not in err and "completed                        0" in out
    assert "errors" in out and ("ClientOSError" in out or "Disconnected" in out or "Timeout" in out), out


@pytest.mark.parametrize("handle", [close_at_once, never_answer])
def test_models_from_a_server_that_closes_or_never_answers_is_one_line(handle, capsys):
    with raw_server(handle) as url:
        rc, out, err = run_cli(["--base-url", url, "--read-timeout", "0.5", *SMALL], capsys)
    assert_one_line(rc, out, err, "/v1/models")


def endless_app() -> FastAPI:
    """A stream that never ends: a token every 10 ms, forever."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        async def events():
            while True:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
                await asyncio.sleep(0.01)
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_an_endless_stream_ends_at_the_request_timeout(capsys):
    with serve_in_thread(endless_app()) as url:
        t0 = time.monotonic()
        rc, out, err = run_cli(["--base-url", url, "--model", "m", "--request-timeout", "1", *SMALL], capsys)
    assert time.monotonic() - t0 < 15
    assert rc == 1 and "Traceback" not in err and "Timeout" in out, out


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_goodput_target_that_is_not_a_finite_positive_number_is_refused(value):
    from kvlab.common.errors import ConfigError
    from kvlab.experiments.loadgen.latency import parse_goodput
    with pytest.raises(ConfigError, match="finite number of ms > 0"):
        parse_goodput([f"ttft:{value}"])
