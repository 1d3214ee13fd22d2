"""kvlab bench serve speaks `vllm bench serve`: a real vLLM command line runs unchanged, against a server kvlab
did not write (mocktopus from PyPI: chat completions only, text prompts only), and the saved result has vLLM's
keys."""
from __future__ import annotations

import asyncio
import json
import shlex
import socket
import threading
from contextlib import contextmanager

import pytest
from aiohttp import web

from kvlab.experiments.cli import main as cli
from kvlab.experiments.loadgen import cli as loadgen_cli

VLLM_CHAT_LINE = (
    "vllm bench serve --backend openai-chat --base-url {url} --endpoint /v1/chat/completions --model gpt-4 "
    "--tokenizer tiny --dataset-name random --random-input-len 16 --random-output-len 8 --random-range-ratio 0.5 "
    "--random-prefix-len 4 --num-prompts 6 --request-rate 50 --burstiness 2 --max-concurrency 3 --seed 7 "
    "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --goodput ttft:5000 e2el:10000 "
    "--ignore-eos --save-result --save-detailed --result-dir {out} --result-filename vllm.json")
# vLLM's result flags: a label, metadata, a result directory that does not exist yet, appended records, and no
# per-request lists without --save-detailed
VLLM_RESULT_LINE = (
    "vllm bench serve --backend openai-chat --base-url {url} --model gpt-4 --tokenizer tiny --dataset-name random "
    "--random-input-len 8 --random-output-len 4 --num-prompts 2 --request-rate 20 --seed 3 --append-result "
    "--metadata version=0.3.3 'tp = 1' note=a=b --label nightly --result-dir {out}/new/dir --result-filename r.json")
VLLM_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
VLLM_SUMMARY = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "max_concurrent_requests")


MOCK_ANSWER = "A mocked answer, streamed five characters at a time."


@contextmanager
def serve_aiohttp_in_thread(app: web.Application):
    """An aiohttp application on a free loopback port, on its own event loop in a thread; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        sock.close()


@pytest.fixture(scope="module")
def mocktopus_url():
    """mocktopus (PyPI, not kvlab's): OpenAI chat completions answering every model with MOCK_ANSWER."""
    from mocktopus.core import Rule, Scenario
    from mocktopus.server import MockServer
    scenario = Scenario([Rule(type="llm.openai", when={"model": "*"}, respond={"content": MOCK_ANSWER})])
    with serve_aiohttp_in_thread(MockServer(scenario=scenario).create_app()) as url:
        yield url


def kvlab_argv(line: str) -> list[str]:
    """A `vllm bench serve ...` line as kvlab's argv: only the program name changes."""
    words = shlex.split(line)
    assert words[:3] == ["vllm", "bench", "serve"]
    return ["bench", "serve", *words[3:]]


def test_a_vllm_command_line_parses_with_vllm_meanings(tmp_path):
    args = cli.build_parser().parse_args(kvlab_argv(VLLM_CHAT_LINE.format(url="http://h:1", out=tmp_path)))
    assert (args.backend, args.endpoint, args.dataset, args.input_len, args.output_len) == \
        ("openai-chat", "/v1/chat/completions", "random", 16, 8)
    assert (args.range_ratio, args.prefix_len, args.num_prompts, args.request_rate, args.burstiness) == \
        (0.5, 4, 6, 50.0, 2.0)
    assert (args.max_concurrency, args.seed, args.ignore_eos, args.save_result) == (3, 7, True, True)
    assert args.percentile_metrics == ["ttft", "tpot", "itl", "e2el"] and args.metric_percentiles == ["50", "99"]
    assert args.goodput == ["ttft:5000", "e2el:10000"] and args.result_filename == "vllm.json"


def test_vllm_defaults():
    args = cli.build_parser().parse_args(["bench", "serve"])
    assert (args.backend, args.input_len, args.output_len) == ("openai", 1024, 128)
    assert (loadgen_cli.DEFAULTS["run"], args.dataset, args.num_prompts) == (("random", 1000), None, None)
    assert (args.range_ratio, args.prefix_len, args.request_rate, args.burstiness, args.seed) == \
        (0.0, 0, float("inf"), 1.0, 0)
    assert (args.host, args.port, args.base_url, args.max_concurrency) == ("127.0.0.1", 8000, None, None)
    assert args.percentile_metrics == ["ttft", "tpot", "itl"] and args.metric_percentiles == ["99"]
    assert (args.save_result, args.result_dir, args.result_filename, args.ignore_eos) == (False, None, None, False)


def test_the_vllm_line_runs_unchanged_against_mocktopus(mocktopus_url, tmp_path, capsys):
    rc = cli.main(kvlab_argv(VLLM_CHAT_LINE.format(url=mocktopus_url, out=tmp_path)))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("kvlab bench serve: 6 requests (random, text prompts, 16 in / 8 out tokens) at 50 req/s")
    saved = json.loads((tmp_path / "vllm.json").read_text())
    assert set(VLLM_SUMMARY + VLLM_PER_REQUEST) <= set(saved)
    assert all(len(saved[k]) == 6 for k in VLLM_PER_REQUEST)
    assert saved["completed"] == 6 and saved["errors"] == [""] * 6 and saved["failed"] == 0
    assert saved["generated_texts"] == [MOCK_ANSWER] * 6
    assert all(0 < t for t in saved["ttfts"]) and all(len(i) == n - 1 for i, n in zip(saved["itls"],
                                                                                       saved["output_lens"]))
    # --random-prefix-len 4 plus 16 +- 50%: the tiny preset's byte tokenizer counts one token per character
    assert all(4 + 8 <= n <= 4 + 24 for n in saved["input_lens"])
    assert saved["model_id"] == "gpt-4" and saved["tokenizer_id"] == "tiny" and saved["request_rate"] == 50
    assert {"p50_ttft_ms", "p99_e2el_ms", "mean_itl_ms", "std_tpot_ms"} <= set(saved)
    assert saved["request_goodput"] is not None


def test_sharegpt_from_a_local_file(mocktopus_url, tmp_path, capsys):
    turns = [{"conversations": [{"from": "human", "value": f"question number {i} " * 3},
                                {"from": "gpt", "value": f"an answer {i} " * 4}]} for i in range(5)]
    turns.append({"conversations": [{"from": "human", "value": "hi"}]})      # one turn: skipped, as vLLM does
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(turns))
    rc = cli.main(["bench", "serve", "--backend", "openai-chat", "--base-url", mocktopus_url, "--model", "m",
                   "--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts", "3",
                   "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "s.json"])
    assert rc == 0, capsys.readouterr()
    saved = json.loads((tmp_path / "s.json").read_text())
    lengths = {len(f"question number {i} " * 3) for i in range(5)}       # byte tokenizer: one token a byte
    assert saved["completed"] == 3 and set(saved["input_lens"]) <= lengths


def test_vllm_result_flags_label_metadata_append_and_a_new_result_dir(mocktopus_url, tmp_path, capsys):
    line = VLLM_RESULT_LINE.format(url=mocktopus_url, out=tmp_path)
    for _ in range(2):
        assert cli.main(kvlab_argv(line)) == 0, capsys.readouterr()
    lines = (tmp_path / "new" / "dir" / "r.json").read_text().split("\n")
    records = [json.loads(text) for text in lines]
    assert len(records) == 2 and all(r["completed"] == 2 for r in records)
    for r in records:
        assert (r["label"], r["version"], r["tp"], r["note"]) == ("nightly", "0.3.3", "1", "a=b")
        assert not set(VLLM_PER_REQUEST + ("requests",)) & set(r)
        assert set(VLLM_SUMMARY) <= set(r)
    keys = list(records[0])
    assert keys.index("num_prompts") < keys.index("version") < keys.index("request_rate") < keys.index("duration")


def test_the_default_result_file_name_leads_with_the_label(mocktopus_url, tmp_path, capsys):
    rc = cli.main(["bench", "serve", "--backend", "openai-chat", "--base-url", mocktopus_url, "--model", "gpt-4",
                   "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "2", "--save-result",
                   "--label", "mine", "--result-dir", str(tmp_path / "fresh"), "--disable-tqdm"])
    assert rc == 0, capsys.readouterr()
    [path] = (tmp_path / "fresh").iterdir()
    assert path.name.startswith("mine-inf") and "gpt-4" in path.name and "ttfts" not in json.loads(path.read_text())


@pytest.mark.parametrize("flags", [["--metadata", "novalue"], ["--metadata", "=v"], ["--label", "a\nb"]])
def test_bad_result_flags_are_one_line(flags, tmp_path, capsys):
    rc = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--save-result",
                   "--result-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and ("--metadata" in err or "--label" in err), err


def test_the_model_defaults_to_the_servers_first(mocktopus_url, capsys):
    rc = cli.main(["bench", "serve", "--backend", "openai-chat", "--base-url", mocktopus_url, "--num-prompts", "2",
                   "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0 and "(openai-chat, model gpt-3.5-turbo)" in out and "completed                        2" in out


def test_a_missing_sharegpt_file_is_one_line(tmp_path, capsys):
    rc = cli.main(["bench", "serve", "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "no.json"),
                   "--model", "m"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and cap.err.count("\n") == 1 and "No such file" in cap.err
