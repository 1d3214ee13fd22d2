"""Hostile trace files and `kvlab prefix` flags, one case each (issue 28): the Mooncake loader
(experiments/workloads/prefix.py), the simulate/bench JSONL loader (experiments/workloads/requests.py) and the
prefix study's flags. Each bad input is one ConfigError line naming the file, the line and the field (or, on the
CLI, one stderr line, exit 2, nothing on stdout); each good one loads as written."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvlab.common import machine
from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN
from kvlab.experiments.cli import main as cli
from kvlab.experiments.limits import MAX_LINE_BYTES, MAX_PROMPT_TOKENS
from kvlab.experiments.workloads import jsonl
from kvlab.experiments.workloads import prefix as pw
from kvlab.experiments.workloads.requests import Request, load_trace


def row(**fields) -> str:
    base = {"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [1, 2, 3]}
    return json.dumps({**base, **fields}) + "\n"


def write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def one_line_error(load, path: Path, *phrases: str) -> str:
    with pytest.raises(ConfigError) as e:
        load(path)
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    for phrase in (str(path.name), *phrases):
        assert phrase in text, f"{phrase!r} not in {text!r}"
    return text


# -- Mooncake-schema traces ------------------------------------------------------------------------------------
MOONCAKE_BAD = [
    ("not JSON", "hello\n", ["t.jsonl:1: need {timestamp, input_length, output_length[, hash_ids]}", "not JSON"]),
    ("not JSON on line 3", row() + "\n" + "{oops\n", ["t.jsonl:3: need", "not JSON"]),
    ("binary file", bytes(range(256)) * 4, ["t.jsonl"]),
    ("latin-1 byte", row().encode()[:-1] + b" \xe9\n", ["t.jsonl is not UTF-8 text (line 1, byte"]),
    ("negative hash id", row(hash_ids=[4, -1]), ["t.jsonl:1: hash_ids[1] must be an integer in [0, ", "got -1"]),
    ("input_length 1e12", row(input_length=1e12), ["t.jsonl:1: lengths must be in [1, 4,194,304]",
                                                  "input_length 1000000000000"]),
    ("timestamp Infinity", '{"timestamp": Infinity, "input_length": 4, "output_length": 1}\n',
     ["t.jsonl:1: timestamp must be a finite number >= 0 ms, got inf"]),
    ("timestamp 1e300", row() + row(timestamp=1e300),
     ["t.jsonl:2: arrival (timestamp minus the earliest, 0 ms) must be a finite number in [0, 604800] s"]),
    ("timestamp NaN", '{"timestamp": NaN, "input_length": 4, "output_length": 1}\n',
     ["t.jsonl:1: timestamp must be a finite number", "got nan"]),
    ("timestamp a string", row(timestamp="5"), ["t.jsonl:1: timestamp must be a finite number", "got '5'"]),
    ("negative timestamp", row(timestamp=-3), ["t.jsonl:1: timestamp must be a finite number >= 0 ms, got -3"]),
    ("input_length true", row(input_length=True), ["t.jsonl:1: need", "input_length must be an integer, got True"]),
    ("float hash id", row(hash_ids=[1.5]), ["t.jsonl:1: hash_ids[0] must be an integer in", "got 1.5"]),
    ("hash_ids a string", row(hash_ids="12345"), ["t.jsonl:1: need",
                                                  "hash_ids must be a list of integers, got '12345'"]),
    ("hash_ids null", row(hash_ids=None), ["hash_ids must be a list of integers, got None"]),
    ("hash id beyond 64 bits", row(hash_ids=[2**70]), ["hash_ids[0] must be an integer in [0, 18,446,744,073,709,"]),
    ("output_length -1", row(output_length=-1), ["t.jsonl:1: lengths must be in [1, ", "output_length -1"]),
    ("input_length missing", '{"timestamp": 0, "output_length": 1}\n', ["t.jsonl:1: need", "input_length is missing"]),
    ("a list, not an object", "[1, 2]\n", ["t.jsonl:1: need", "got [1, 2]"]),
    ("nested 100,000 deep", "[" * 100_000 + "\n", ["t.jsonl:1: need", "not JSON"]),
    ("a 5,000-digit length", '{"timestamp": 0, "input_length": ' + "9" * 5000 + ', "output_length": 1}\n',
     ["t.jsonl:1: need", "not JSON"]),
    ("a sequence beyond max_model_len", row(input_length=MAX_MODEL_LEN, output_length=1),
     ["t.jsonl:1: input_length + output_length must be an integer in [2, 4,194,304]"]),
    ("an overlong line", "{" + " " * MAX_LINE_BYTES + "}\n", ["t.jsonl:1: line longer than 4,194,304 bytes"]),
    ("empty file", "\n\n", ["holds no requests"]),
]


@pytest.mark.parametrize("content, phrases", [c[1:] for c in MOONCAKE_BAD], ids=[c[0] for c in MOONCAKE_BAD])
def test_a_hostile_mooncake_trace_is_one_line(tmp_path, content, phrases):
    one_line_error(lambda p: pw.load_mooncake(p, block_size=16), write(tmp_path, content), *phrases)


@pytest.mark.parametrize("block", [-5, 0, 1_000_000_000, "abc", 16.5, True])
def test_a_bad_block_size_is_one_line(block):
    """`mooncake:FILE:BLOCK` suffixes -5, 0, 10^9 (and abc, as the loader is handed it)."""
    with pytest.raises(ConfigError) as e:
        pw.load_mooncake(pw.SAMPLE_TRACE, block_size=block)
    assert str(e.value).startswith("block size must be an integer in [1, 4,194,304] (tokens per hash id), got ")


@pytest.mark.parametrize("suffix", [":-5", ":0", ":abc", ":1000000000", ":16.5", ":" + "9" * 5000])
def test_a_bad_block_suffix_is_one_line(suffix):
    """What experiments/loadgen/datasets.py should call for `mooncake:FILE:BLOCK` (it still calls int())."""
    with pytest.raises(ConfigError) as e:
        pw.parse_mooncake("t.jsonl" + suffix)
    text = str(e.value)
    assert text.startswith("mooncake block size must be an integer in [1, 4,194,304] (tokens per hash id), got ")
    assert len(text) < 200


def test_a_good_block_suffix_or_none_parses():
    assert pw.parse_mooncake("t.jsonl:16") == ("t.jsonl", 16)
    assert pw.parse_mooncake("t.jsonl") == ("t.jsonl", pw.MOONCAKE_BLOCK)


def test_prompts_beyond_the_token_limit_stop_at_the_line_that_crosses_it(tmp_path):
    lines = MAX_PROMPT_TOKENS // (MAX_MODEL_LEN - 1) + 1
    path = write(tmp_path, row(input_length=MAX_MODEL_LEN - 1, output_length=1) * lines)
    one_line_error(lambda p: pw.load_mooncake(p, block_size=16), path, f"t.jsonl:{lines}: the trace's prompts reach",
                   "MAX_PROMPT_TOKENS")


def test_a_directory_or_a_missing_file_is_one_line(tmp_path):
    one_line_error(pw.load_mooncake, tmp_path, "is not a file")
    one_line_error(pw.load_mooncake, tmp_path / "missing.jsonl", "does not exist")


@pytest.mark.parametrize("kwargs, phrase", [
    ({"vocab_size": 3}, "vocab_size must be an integer in [4, 16,777,216] (ids below 3 are special), got 3"),
    ({"vocab_size": "32000"}, "vocab_size must be an integer in [4, "),
    ({"seed": -1}, "seed must be an integer in [0, 9,223,372,036,854,775,807], got -1"),
    ({"limit": 0}, "limit must be an integer in [1, 1,000,000], got 0")])
def test_bad_loader_arguments_are_one_line(kwargs, phrase):
    with pytest.raises(ConfigError) as e:
        pw.load_mooncake(pw.SAMPLE_TRACE, block_size=16, **kwargs)
    assert str(e.value) == phrase or str(e.value).startswith(phrase)


def test_a_trace_longer_than_max_requests_without_a_limit_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "MAX_REQUESTS", 2)
    path = write(tmp_path, row() * 3)
    one_line_error(pw.load_mooncake, path, "t.jsonl:3: the trace holds more than 2 requests (MAX_REQUESTS)")
    assert len(pw.load_mooncake(path, limit=2)) == 2


def test_what_other_writers_produce_loads_as_written(tmp_path):
    """A byte-order mark, CRLF line ends, integral floats (pandas), keys beyond the schema and unsorted
    timestamps: arrivals count from the earliest."""
    text = ('{"timestamp": 500.0, "input_length": 40.0, "output_length": 4, "hash_ids": [1, 2], "extra": "x"}\r\n'
            '{"timestamp": 200, "input_length": 8, "output_length": 2}\r\n')
    reqs = pw.load_mooncake(write(tmp_path, b"\xef\xbb\xbf" + text.encode()), block_size=16, vocab_size=100)
    assert [(len(r.token_ids), r.output_len, r.arrival_s) for r in reqs] == [(40, 4, 0.3), (8, 2, 0.0)]
    assert reqs[0].token_ids[:16] == pw.block_tokens(1, 16, 100)


# -- the simulate / bench trace -----------------------------------------------------------------------------------
REQUESTS_BAD = [
    ("not JSON", "hello\n", ["t.jsonl:1: need {prompt_len, output_len[, arrival_s]}", "not JSON"]),
    ("prompt_len true", '{"prompt_len": true, "output_len": 4}\n', ["t.jsonl:1: need",
                                                                     "prompt_len must be an integer"]),
    ("prompt_len 1.5", '{"prompt_len": 1.5, "output_len": 4}\n', ["prompt_len must be an integer, got 1.5"]),
    ("prompt_len a string", '{"prompt_len": "8", "output_len": 4}\n', ["prompt_len must be an integer, got '8'"]),
    ("prompt_len 1e12", '{"prompt_len": 1e12, "output_len": 4}\n', ["t.jsonl:1: lengths must be in [1, 4,194,304]"]),
    ("arrival NaN", '{"prompt_len": 8, "output_len": 4, "arrival_s": NaN}\n',
     ["t.jsonl:1: arrival_s must be a finite number in [0, 604800] s, got nan"]),
    ("arrival a string", '{"prompt_len": 8, "output_len": 4, "arrival_s": "5"}\n', ["arrival_s", "got '5'"]),
    ("arrival true", '{"prompt_len": 8, "output_len": 4, "arrival_s": true}\n', ["arrival_s", "got True"]),
    ("a misspelt key", '{"prompt_len": 8, "output_len": 4, "arival_s": 3}\n', ["t.jsonl:1: need",
                                                                              "unknown key 'arival_s'"]),
    ("a list, not an object", "[8, 4]\n", ["t.jsonl:1: need", "got [8, 4]"]),
    ("nested 100,000 deep", '{"prompt_len": ' + "[" * 100_000 + "\n", ["t.jsonl:1: need", "not JSON"]),
    ("latin-1 byte", b'{"prompt_len": 8, "output_len": 4} \xe9\n', ["t.jsonl is not UTF-8 text (line 1"]),
    ("an overlong line", '{"prompt_len": 8, "output_len": 4}' + " " * MAX_LINE_BYTES + "\n",
     ["t.jsonl:1: line longer than"]),
]


@pytest.mark.parametrize("content, phrases", [c[1:] for c in REQUESTS_BAD], ids=[c[0] for c in REQUESTS_BAD])
def test_a_hostile_simulate_trace_is_one_line(tmp_path, content, phrases):
    one_line_error(load_trace, write(tmp_path, content), *phrases)


def test_a_scaled_trace_beyond_max_model_len_is_one_line(tmp_path):
    path = write(tmp_path, '{"prompt_len": 4000000, "output_len": 4000}\n')
    one_line_error(lambda p: load_trace(p, scale=2.0), path, "t.jsonl:1: scaled prompt_len + output_len")


@pytest.mark.parametrize("scale", [math.nan, math.inf, 0.0, -1.0, "2"])
def test_a_bad_scale_is_one_line(tmp_path, scale):
    path = write(tmp_path, '{"prompt_len": 8, "output_len": 4}\n')
    with pytest.raises(ConfigError, match="^length scale must be a finite number > 0 and <= 4194304, got "):
        load_trace(path, scale=scale)


def test_integral_floats_and_blank_lines_load(tmp_path):
    path = write(tmp_path, '\n{"prompt_len": 8.0, "output_len": 4, "arrival_s": 2}\n\n')
    assert load_trace(path) == [Request(8, 4, 2.0)]


# -- kvlab prefix ------------------------------------------------------------------------------------------------
PREFIX_BAD = [
    (["--budget-gb", "nan"], "--budget-gb must be a finite number > 0 and <= 100000, got nan"),
    (["--budget-gb", "1e9"], "--budget-gb must be a finite number > 0 and <= 100000, got 1000000000.0"),
    (["--budget-gb", "inf"], "--budget-gb must be a finite number > 0"),
    (["--budget-gb", "0"], "--budget-gb must be a finite number > 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 9,223,372,036,854,775,807], got -1"),
    (["--seed", str(2**64 - 1)], "--seed must be an integer in [0, "),
    (["--workloads", "trace,nope"], "unknown --workloads entry 'nope'"),
    (["--out", "/proc/kvlab-results"], "--out '/proc/kvlab-results': cannot write there"),
]


@pytest.mark.parametrize("argv, phrase", PREFIX_BAD, ids=[" ".join(a) for a, _ in PREFIX_BAD])
def test_kvlab_prefix_refuses_a_bad_flag_before_any_work(capsys, argv, phrase):
    code = cli.main(["prefix", "--runs", "sim", "--workloads", "trace", "--quick", *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(f"kvlab prefix: error: {phrase}") and err.count("\n") == 1


def test_kvlab_prefix_refuses_a_budget_whose_books_exceed_ram(capsys, monkeypatch):
    monkeypatch.setattr(machine, "ram_bytes", lambda: 16 * 2**30)
    code = cli.main(["prefix", "--runs", "sim", "--workloads", "trace", "--quick", "--budget-gb", "100000"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "kvlab prefix: error: --budget-gb 100000 (the simulator's books" in err and "16.0 GiB" in err
