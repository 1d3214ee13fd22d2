"""A JSONL trace read one bounded line at a time. Whatever a file holds (binary data, bad UTF-8, lines that are
not JSON objects, overlong or deeply nested lines, fields of the wrong type or out of range), reading it ends in
at most one ConfigError line that names the file, the line number and the field: never another exception,
never an unbounded read."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import as_int, check_group, check_int, check_number, shown
from kvlab.experiments.limits import MAX_LINE_BYTES, MAX_REQUESTS


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One parsed line and where it came from; its getters check a field through the validation layer."""
    where: str                     # "path:lineno", the start of every message
    row: dict
    schema: str                    # what a line holds, e.g. "{prompt_len, output_len[, arrival_s]}"

    def fail(self, why: str) -> ConfigError:
        return ConfigError(f"{self.where}: need {self.schema}: {why}")

    def value(self, key: str) -> Any:
        if key not in self.row:
            raise self.fail(f"{key} is missing")
        return self.row[key]

    def integer(self, key: str) -> int:
        number = as_int(self.value(key))
        if number is None:
            raise self.fail(f"{key} must be an integer, got {shown(self.row[key])}")
        return number

    def lengths(self, *keys: str, high: int) -> list[int]:
        """Token counts, each an integer in [1, high], reported together when one is out of range."""
        values = {key: self.integer(key) for key in keys}
        return check_group(f"{self.where}: lengths", values, 1, high)

    def number(self, key: str, high: float, unit: str = "", default: float | None = None) -> float:
        """A finite number in [0, high]; `default` when the key is absent (None: the key is required)."""
        if default is not None and key not in self.row:
            return default
        return check_number(f"{self.where}: {key}", self.value(key), 0.0, high, unit=unit)

    def integers(self, key: str, high: int, default: list[int] | None = None) -> list[int]:
        """A list of integers in [0, high]; `default` when the key is absent."""
        if default is not None and key not in self.row:
            return default
        items = self.value(key)
        if not isinstance(items, list):
            raise self.fail(f"{key} must be a list of integers, got {shown(items)}")
        return [check_int(f"{self.where}: {key}[{i}]", item, 0, high) for i, item in enumerate(items)]

    def only(self, keys: tuple[str, ...]) -> None:
        unknown = [k for k in self.row if k not in keys]
        if unknown:
            raise self.fail(f"unknown key {shown(unknown[0])}")


def request_lines(path: str | Path | None, schema: str, limit: int | None) -> Iterator[TraceLine]:
    """The first `limit` lines, one request each; with no limit all of them, refused beyond MAX_REQUESTS."""
    cap = MAX_REQUESTS if limit is None else check_int("limit", limit, 1, MAX_REQUESTS)
    count = 0
    for line in trace_lines(path, schema):
        if count == cap:
            if limit is None:
                raise ConfigError(f"{line.where}: the trace holds more than {MAX_REQUESTS:,} requests "
                                  "(MAX_REQUESTS); give a limit")
            return
        count += 1
        yield line
    if not count:
        raise ConfigError(f"trace file {path} holds no requests")


def trace_lines(path: str | Path | None, schema: str) -> Iterator[TraceLine]:
    """The non-blank lines of a JSONL file, each a JSON object; line numbers count blank lines too."""
    if path is None or not Path(path).exists():
        raise ConfigError(f"trace file {path} does not exist")
    if not Path(path).is_file():
        raise ConfigError(f"trace file {path} is not a file")
    try:
        with open(path, "rb") as f:
            yield from _parsed(f, str(path), schema)
    except OSError as e:
        raise ConfigError(f"trace file {path}: cannot read it ({e.strerror or e})") from None


def _parsed(f: Any, name: str, schema: str) -> Iterator[TraceLine]:
    for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
        if len(raw) > MAX_LINE_BYTES:
            raise ConfigError(f"{name}:{lineno}: line longer than {MAX_LINE_BYTES:,} bytes (MAX_LINE_BYTES); "
                              "is this a JSONL trace?")
        text = _decoded(raw, name, lineno)
        if text.strip():
            yield TraceLine(f"{name}:{lineno}", _object(text, f"{name}:{lineno}", schema), schema)


def _decoded(raw: bytes, name: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name} is not UTF-8 text (line {lineno}, byte {e.start + 1})") from None


def _object(text: str, where: str, schema: str) -> dict:
    try:
        row = json.loads(text)
    except (ValueError, RecursionError) as e:   # RecursionError: a line nested thousands of levels deep
        raise ConfigError(f"{where}: need {schema}: not JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: need {schema}: got {shown(row)}")
    return row
