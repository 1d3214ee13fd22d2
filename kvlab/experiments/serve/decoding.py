"""Per-response text state: token ids -> text deltas, with stop strings cut out (the engine stops on token ids
only; stop strings are matched here, on the decoded text).

Detokenization is incremental, as vLLM does it: each new token decodes a short window (the ids since the last
emitted text, plus the ids before them as context, so a tokenizer that strips a leading space or merges bytes
across tokens gives the same text as one decode of everything), never the whole output again. The text waits
while the window ends in U+FFFD (a character whose bytes have not all arrived yet).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.experiments.serve.stop_scan import StopScan, borders

REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class Sample:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""                      # text sent so far
    decoded: str = ""                   # text decoded so far: sent, plus what is held back (a stop string's start)
    prefix_offset: int = 0              # token_ids[prefix_offset:read_offset] decoded to the end of `decoded`
    read_offset: int = 0
    window_text: str | None = ""        # that window's text: None until decoded (once per move of the offsets)
    finish_reason: str | None = None
    scans: list[StopScan] = field(default_factory=list)     # one per stop string, fed `decoded` as it grows


class Decoding:
    def __init__(self, tokenizer: Any, n: int, stop: list[str]) -> None:
        self.decode = tokenizer.decode if tokenizer is not None else None
        self.stop = stop
        tables = [borders(x) for x in stop]
        self.samples = [Sample(scans=[StopScan(x, t) for x, t in zip(stop, tables)]) for _ in range(n)]

    def all_stopped(self) -> bool:
        return bool(self.stop) and all(s.finish_reason == "stop" for s in self.samples)

    def add(self, i: int, new_ids: list[int], final: bool = False) -> tuple[list[int], str]:
        """Append tokens to sample i; returns the ids and text to send now ((), "" once stopped)."""
        s = self.samples[i]
        if s.finish_reason is not None:
            return [], ""
        s.token_ids.extend(new_ids)
        if self.decode is None:
            return new_ids, ""
        new_text = self._new_text(s, final)
        s.decoded += new_text
        for scan in s.scans:
            scan.feed(new_text)
        full = s.decoded
        cut = self._stop_at(full, len(s.text))
        if cut is not None:
            full, s.finish_reason = full[:cut], "stop"
        elif not final:
            full = full[:len(full) - max((scan.held() for scan in s.scans), default=0)]
        delta = full[len(s.text):] if full.startswith(s.text) else ""
        s.text += delta
        return new_ids, delta

    def _new_text(self, s: Sample, final: bool) -> str:
        ids = s.token_ids
        before = s.window_text
        if before is None:                  # held text re-decodes only the growing window, not this one too
            before = s.window_text = self.decode(ids[s.prefix_offset:s.read_offset])
        after = self.decode(ids[s.prefix_offset:])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        s.prefix_offset, s.read_offset, s.window_text = s.read_offset, len(ids), None
        return after[len(before):]

    def _stop_at(self, text: str, sent: int) -> int | None:
        start = max(0, sent - max((len(x) for x in self.stop), default=0))
        hits = [p for p in (text.find(x, start) for x in self.stop) if p >= 0]
        return min(hits) if hits else None

    def finish(self, i: int, reason: str | None) -> None:
        s = self.samples[i]
        if s.finish_reason is None:
            s.finish_reason = reason

