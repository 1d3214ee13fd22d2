"""The load generator's SSE reader: however the bytes are split between reads, it yields each `data:` line's value,
as reading line by line did; an endless line is an error, not unbounded memory."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.experiments.loadgen import client


class Pieces:
    """What read_stream uses of aiohttp's StreamReader: the bytes as they arrive."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def read_all(pieces: list[bytes]) -> list[bytes]:
    async def run() -> list[bytes]:
        return [data async for data in client.sse_data(Pieces(pieces))]
    return asyncio.run(run())


def by_lines(stream: bytes) -> list[bytes]:
    return [line[5:].strip() for line in stream.splitlines(keepends=True) if line.startswith(b"data:")]


STREAM = (b'data: {"choices": [{"text": "a"}]}\n\n: a comment\ndata:{"x": 1}\r\n\r\nevent: ping\n'
          b'data: {"t": "\xc3\xa9\\n"}\n\ndata: [DONE]\n\ndata: tail-without-newline')


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_reads_the_same_data_lines(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in zip(bounds, bounds[1:])]
    assert read_all(pieces) == by_lines(STREAM)
    assert read_all(pieces)[-2:] == [b"[DONE]", b"tail-without-newline"]


def test_a_line_past_the_limit_is_an_error(monkeypatch):
    monkeypatch.setattr(client, "MAX_LINE", 10)
    assert read_all([b"data: 12345\n"]) == [b"12345"]
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        read_all([b"data: 1234567890", b"1"])
