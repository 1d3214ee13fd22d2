"""The validation layer (common/validate.py, common/limits.py check_seed): each check returns the value in its
type or raises one ConfigError line naming the value; hypothesis draws hostile values for every check."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab.common.errors import ConfigError, RequestError
from kvlab.common.limits import MAX_SEED, check_seed
from kvlab.common.request import generator_seed
from kvlab.common.validate import (
    SHOWN_CHARS,
    as_int,
    check_group,
    check_int,
    check_number,
    check_output_path,
    check_text,
    parse_int,
    shown,
)

ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(), st.binary(),
                     st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def one_line(e: pytest.ExceptionInfo, *phrases: str) -> None:
    text = str(e.value)
    assert "\n" not in text and len(text) < 300, text
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in {text!r}"


# -- integers --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [(3, 3), (3.0, 3), (-2, -2), (1e3, 1000), (2**70, 2**70)])
def test_an_integer_or_a_float_without_a_fraction_is_an_int(value, expected):
    assert as_int(value) == expected and type(as_int(value)) is int


@pytest.mark.parametrize("value", [True, False, 1.5, math.nan, math.inf, -math.inf, "3", None, [3], 2.0**60])
def test_bool_fraction_non_finite_string_and_imprecise_floats_are_not_ints(value):
    assert as_int(value) is None
    with pytest.raises(ConfigError) as e:
        check_int("n", value, -10, 10)
    one_line(e, "n must be an integer in [-10, 10]", "got ")


def test_check_int_names_the_bound_and_raises_the_error_class_asked_for():
    assert check_int("n", 4.0, 1, 8) == 4
    with pytest.raises(ConfigError) as e:
        check_int("input_length", 10**12, 1, 2**22, " (tokens per sequence)")
    one_line(e, "input_length must be an integer in [1, 4,194,304] (tokens per sequence), got 1000000000000")
    with pytest.raises(RequestError):
        check_int("max_tokens", 0, 1, 8, error=RequestError)


@given(st.text(max_size=12) | st.integers(-300, 300).map(str))
def test_parse_int_reads_decimal_text_or_raises_one_line(text):
    try:
        out = parse_int("--n", text, -200, 200)
    except ConfigError as e:
        assert str(e).startswith("--n must be an integer in [-200, 200], got ") and "\n" not in str(e)
    else:
        assert out == int(text) and -200 <= out <= 200


@given(ANYTHING, st.integers(-100, 100), st.integers(0, 200))
def test_check_int_returns_an_int_in_range_or_raises_one_line(value, low, width):
    try:
        out = check_int("x", value, low, low + width)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("x must be an integer in")
    else:
        assert type(out) is int and low <= out <= low + width and out == value and not isinstance(value, bool)


# -- numbers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "1", None, 10**400, -0.5, 7.5])
def test_check_number_refuses_non_finite_bool_strings_huge_ints_and_out_of_range(value):
    with pytest.raises(ConfigError) as e:
        check_number("arrival_s", value, 0.0, 7.0, unit=" s")
    one_line(e, "arrival_s must be a finite number in [0, 7] s, got ")


def test_check_number_bounds_read_as_written():
    assert check_number("rate", 3) == 3.0 and type(check_number("rate", 3)) is float
    with pytest.raises(ConfigError) as e:
        check_number("--budget-gb", 0.0, 0.0, 100.0, strict=True)
    one_line(e, "--budget-gb must be a finite number > 0 and <= 100, got 0.0")
    with pytest.raises(ConfigError) as e:
        check_number("rate", -3.0)
    one_line(e, "rate must be a finite number >= 0, got -3.0")


@given(ANYTHING, st.floats(-1e6, 1e6), st.floats(0, 1e6), st.booleans())
def test_check_number_returns_a_finite_float_in_range_or_raises_one_line(value, low, width, strict):
    try:
        out = check_number("x", value, low, low + width, strict=strict)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("x must be a finite number")
    else:
        assert type(out) is float and math.isfinite(out) and low <= out <= low + width
        assert not strict or out > low


def test_check_group_reports_every_value_of_the_group():
    assert check_group("lengths", {"a": 1, "b": 2.0}, 1, 9) == [1, 2]
    with pytest.raises(ConfigError) as e:
        check_group("t.jsonl:3: lengths", {"prompt_len": -5, "output_len": 4}, 1, 2**22)
    one_line(e, "t.jsonl:3: lengths must be in [1, 4,194,304], got prompt_len -5, output_len 4")


# -- seeds -----------------------------------------------------------------------------------------------------
def test_the_seed_range_is_what_the_engine_keeps_apart():
    """torch seeds -1 as 2**64 - 1, and the per-request generators keep 63 bits: s and s + 2**63 give the same
    tokens. So seeds are [0, 2**63): both colliding spellings are refused, not silently merged."""
    assert torch.Generator().manual_seed(-1).initial_seed() == torch.Generator().manual_seed(2**64 - 1).initial_seed()
    assert generator_seed(5, 0) == generator_seed(5 + 2**63, 0)
    assert generator_seed(-1, 0) == generator_seed(2**64 - 1, 0)
    assert check_seed("seed", 0) == 0 and check_seed("seed", MAX_SEED) == 2**63 - 1
    for bad in (-1, 2**63, 2**64 - 1, 2**64, 1.5, True, "3"):
        with pytest.raises(ConfigError) as e:
            check_seed("--seed", bad)
        one_line(e, "--seed must be an integer in [0, 9,223,372,036,854,775,807]")


@given(st.integers(-2**70, 2**70))
def test_a_seed_is_accepted_exactly_when_it_is_in_range(seed):
    try:
        assert check_seed("seed", seed) == seed and 0 <= seed < 2**63
    except ConfigError:
        assert not 0 <= seed < 2**63


# -- text ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, phrase", [("a\0b", "must not contain a NUL"), ("x\udcff", "not valid UTF-8"),
                                           (b"bytes", "must be a string"), (5, "must be a string"),
                                           ("x" * 11, "at most 10 characters, got 11")])
def test_check_text_refuses_nul_lone_surrogates_non_strings_and_overlong(value, phrase):
    with pytest.raises(ConfigError) as e:
        check_text("name", value, 10)
    one_line(e, "name ", phrase)


@given(st.text(max_size=30))
def test_check_text_accepts_exactly_the_nul_free_utf8_strings(text):
    try:
        assert check_text("s", text, 30) == text
    except ConfigError as e:
        assert "\0" in text or any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        assert str(e).encode("utf-8") and "\n" not in str(e)   # the message itself prints anywhere


@given(ANYTHING)
def test_shown_is_one_short_printable_line(value):
    text = shown(value)
    assert "\n" not in text and len(text) <= SHOWN_CHARS + 3 and text.encode("utf-8")


# -- output paths ----------------------------------------------------------------------------------------------
def test_an_output_path_is_checked_before_work_and_the_probe_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    assert check_output_path("--json", tmp_path / "out.json") == tmp_path / "out.json"
    assert check_output_path("--out", tmp_path / "new" / "deeper", directory=True) == tmp_path / "new" / "deeper"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]          # the probe made and removed new/deeper
    cases = [(tmp_path / "file", True, "exists and is not a directory"),
             (tmp_path, False, "is a directory; give a file path"),
             (tmp_path / "missing" / "out.json", False, "does not exist"),
             (tmp_path / "file" / "sub", True, "cannot write there"),
             ("/proc/kvlab-results.json", False, "cannot write there"),     # refused even to root
             ("a\0b", False, "must not contain a NUL")]
    for path, directory, phrase in cases:
        with pytest.raises(ConfigError) as e:
            check_output_path("--out", path, directory=directory)
        one_line(e, "--out", phrase)


def test_a_home_of_an_unknown_user_is_a_missing_model_not_a_crash():
    # pathlib's expanduser raises RuntimeError for ~user with no such user; found by tests/test_cli_fuzz.py
    from kvlab.common.errors import ModelLoadError
    from kvlab.common.loader import locate
    from kvlab.common.validate import user_path
    assert str(user_path("~no-such-user-kvlab/m")) == "~no-such-user-kvlab/m"
    with pytest.raises(ModelLoadError, match="does not exist"):
        locate("~no-such-user-kvlab")


def test_an_output_path_with_a_nul_byte_is_one_line():
    # the writable probe's os.rmdir raised ValueError("embedded null byte") before the text check ran
    from kvlab.experiments.cli.flags import check_output_path
    with pytest.raises(ConfigError, match="NUL"):
        check_output_path("a\x00b", "--out")


def test_sigterm_unwinds_only_its_own_process_and_restores_the_handler():
    import os
    import signal

    from kvlab.experiments.loadgen.sweep import sigterm_unwinds
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_unwinds():
        pid = os.fork()
        if pid == 0:                                  # a forked worker: SIGTERM ends it as by default
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)                               # not reached
        _, status = os.waitpid(pid, 0)
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
