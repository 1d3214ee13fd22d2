"""Hypothesis draws trace files from each schema's neighbourhood (wrong types, NaN/inf/huge/negative numbers,
missing and extra keys, bad UTF-8, cut, nested, non-object and overlong lines) and checks both loaders against a
model of the schema written here: a file the model accepts loads as written; otherwise the loader raises one
ConfigError line naming the file, the first bad line and (for a bad field) the field; never another exception.
A hang fails through the test's timeout. Bounded examples by default, 25x more under `-m slow`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN
from kvlab.common.validate import shown
from kvlab.experiments.limits import MAX_HASH_ID, MAX_LINE_BYTES, MAX_SPAN_S
from kvlab.experiments.workloads import prefix as pw
from kvlab.experiments.workloads.requests import load_trace

EXAMPLES, SLOW_EXAMPLES = 60, 1500
HOSTILE = [math.nan, math.inf, -math.inf, True, False, None, "8", "", [], {}, [1], -1, 0, 1.5, -0.0, 2.0**60,
           1e12, 1e300, 10**12, 2**63, 2**64, 2**70, -2**70, 10**30]


# -- the model -------------------------------------------------------------------------------------------------
def integer(v: Any) -> int | None:
    if type(v) is int:
        return v
    if type(v) is float and math.isfinite(v) and v == int(v) and abs(v) <= 2**53:
        return int(v)
    return None


def finite(v: Any) -> float | None:
    if type(v) not in (int, float):
        return None
    try:
        number = float(v)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


@dataclass
class Verdict:
    line: int | None                   # the first bad line (None: the file loads)
    fields: tuple[str, ...] = ()        # the fields that make it bad (empty: the line itself is bad)


def parse(raw: bytes, lineno: int) -> dict | str | None:
    """The line's object, None for a blank line, "bad" for a line that is not one JSON object."""
    if len(raw) + 1 > MAX_LINE_BYTES:
        return "bad"
    try:
        text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        if not text.strip():
            return None
        row = json.loads(text)
    except (ValueError, RecursionError):
        return "bad"
    return row if isinstance(row, dict) else "bad"


def lengths_bad(row: dict, keys: tuple[str, str]) -> tuple[str, ...]:
    """Each an integer in [1, MAX_MODEL_LEN]; their sum is checked apart (the loaders do it at different times)."""
    if any(k not in row or integer(row[k]) is None for k in keys):
        return tuple(k for k in keys if k not in row or integer(row[k]) is None)
    return keys if any(not 1 <= integer(row[k]) <= MAX_MODEL_LEN for k in keys) else ()


def sum_bad(row: dict, keys: tuple[str, str]) -> tuple[str, ...]:
    return keys if sum(integer(row[k]) for k in keys) > MAX_MODEL_LEN else ()


def mooncake_bad(row: dict) -> tuple[str, ...]:
    keys = ("input_length", "output_length")
    bad = lengths_bad(row, keys) or sum_bad(row, keys)
    if bad:
        return bad
    if "timestamp" not in row or finite(row["timestamp"]) is None or finite(row["timestamp"]) < 0:
        return ("timestamp",)
    ids = row.get("hash_ids", [])
    if not isinstance(ids, list) or any(integer(h) is None or not 0 <= integer(h) <= MAX_HASH_ID for h in ids):
        return ("hash_ids",)
    return ()


def requests_bad(row: dict) -> tuple[str, ...]:
    unknown = tuple(k for k in row if k not in ("prompt_len", "output_len", "arrival_s"))
    if unknown:
        return unknown
    keys = ("prompt_len", "output_len")
    bad = lengths_bad(row, keys)
    if bad:
        return bad
    arrival = finite(row.get("arrival_s", 0.0))
    return sum_bad(row, keys) if arrival is not None and 0 <= arrival <= MAX_SPAN_S else ("arrival_s",)


def verdict(lines: list[bytes], row_bad) -> tuple[Verdict, list[tuple[int, dict]]]:
    rows = []
    for lineno, raw in enumerate(lines, 1):
        row = parse(raw, lineno)
        if row == "bad":
            return Verdict(lineno), rows
        if row is not None:
            bad = row_bad(row)
            if bad:
                return Verdict(lineno, bad), rows
            rows.append((lineno, row))
    return Verdict(None if rows else 0), rows


# -- the files -------------------------------------------------------------------------------------------------
def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A valid value 9 times in 10 (so that whole files load too), else a hostile one."""
    hostile = st.one_of(st.sampled_from(HOSTILE), st.floats(), st.integers(), st.text(max_size=3))
    return st.integers(0, 9).flatmap(lambda k: valid if k else hostile)


@st.composite
def row_dict(draw, schema: dict[str, st.SearchStrategy]) -> dict:
    row = {k: draw(v) for k, v in schema.items()}
    if draw(st.integers(0, 5)) == 0:
        row.pop(draw(st.sampled_from(sorted(row))))
    if draw(st.integers(0, 5)) == 0:
        row[draw(st.text(max_size=4))] = draw(st.integers())      # extra keys, lone surrogates included
    return row


@st.composite
def line(draw, schema: dict[str, st.SearchStrategy]) -> bytes:
    raw = json.dumps(draw(row_dict(schema))).encode()
    kind = draw(st.integers(0, 30))
    if kind == 0:
        cut = draw(st.integers(0, len(raw)))
        return raw[:cut] + draw(st.sampled_from([b"\xff", b"\xe9", b"\x00", b"\xed\xa0\x80", b"\xc3"])) + raw[cut:]
    if kind == 1:
        return raw[:draw(st.integers(0, len(raw)))]
    if kind == 2:
        return draw(st.sampled_from([b"[" * 50_000, b"[1, 2]", b"7", b'"x"', b"null", b"", b"   ", b"\x00" * 9]))
    if kind == 3 and draw(st.integers(0, 9)) == 0:                  # rare: 4 MiB each
        return raw + b" " * (MAX_LINE_BYTES - len(raw) + draw(st.integers(-2, 2)))
    return raw


def write(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(raw + b"\n" for raw in lines))
    return path


def check_error(e: ConfigError, path: Path, v: Verdict) -> None:
    event("refused: a bad field" if v.fields else "refused: a bad line" if v.line else "refused: no requests")
    text = str(e)
    assert "\n" not in text and len(text) < 400, text
    if v.line == 0:
        assert "holds no requests" in text and str(path) in text
        return
    assert f"{path}:{v.line}:" in text or f"{path} is not UTF-8 text (line {v.line}," in text, (v, text)
    if v.fields:
        assert any(f in text or shown(f) in text for f in v.fields), (v, text)    # shown: an escaped, cut key


SMALL = st.integers(0, 19).flatmap(lambda k: st.integers(1, 40) if k else st.sampled_from([MAX_MODEL_LEN - 1, 2**10]))
MOONCAKE = {"timestamp": field(st.floats(0, 1e8) | st.integers(0, 10**8)),           # within a week, mostly
            "input_length": field(SMALL), "output_length": field(st.integers(1, 8)),
            "hash_ids": field(st.lists(st.integers(0, 2**64 - 1), max_size=4))}
REQUESTS = {"prompt_len": field(SMALL), "output_len": field(st.integers(1, 8)),
            "arrival_s": field(st.floats(0, MAX_SPAN_S) | st.integers(0, 10))}


# -- the properties ----------------------------------------------------------------------------------------------
def mooncake_property(tmp_path: Path, lines: list[bytes]) -> None:
    path = write(tmp_path, lines)
    v, rows = verdict(lines, mooncake_bad)
    if v.line is None:
        t0 = min(finite(r["timestamp"]) for _, r in rows)
        late = [n for n, r in rows if (finite(r["timestamp"]) - t0) / 1000 > MAX_SPAN_S]
        v = Verdict(late[0], ("timestamp",)) if late else v
    try:
        reqs = pw.load_mooncake(path, block_size=16, vocab_size=100)
    except ConfigError as e:
        assert v.line is not None, f"refused a good file: {e}"
        check_error(e, path, v)
        return
    assert v.line is None, f"accepted a bad file: {v}"
    event("loaded")
    assert [(len(r.token_ids), r.output_len, r.arrival_s) for r in reqs] == \
        [(integer(r["input_length"]), integer(r["output_length"]), (finite(r["timestamp"]) - t0) / 1000)
         for _, r in rows]


def requests_property(tmp_path: Path, lines: list[bytes]) -> None:
    path = write(tmp_path, lines)
    v, rows = verdict(lines, requests_bad)
    try:
        reqs = load_trace(path)
    except ConfigError as e:
        assert v.line is not None, f"refused a good file: {e}"
        check_error(e, path, v)
        return
    assert v.line is None, f"accepted a bad file: {v}"
    event("loaded")
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in reqs] == \
        [(integer(r["prompt_len"]), integer(r["output_len"]), finite(r.get("arrival_s", 0.0))) for _, r in rows]


def drawn(examples: int, schema: dict, prop):
    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(lines=st.lists(line(schema), min_size=1, max_size=4))
    def test(tmp_path, lines):
        prop(tmp_path, lines)
    return pytest.mark.timeout(600)(test)


test_mooncake_files_load_or_fail_in_one_line = drawn(EXAMPLES, MOONCAKE, mooncake_property)
test_simulate_files_load_or_fail_in_one_line = drawn(EXAMPLES, REQUESTS, requests_property)
test_mooncake_files_slow = pytest.mark.slow(drawn(SLOW_EXAMPLES, MOONCAKE, mooncake_property))
test_simulate_files_slow = pytest.mark.slow(drawn(SLOW_EXAMPLES, REQUESTS, requests_property))
