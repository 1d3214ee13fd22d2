"""Per-response text state: token ids -> text deltas, with stop strings cut out (the engine stops on token ids
only; stop strings are matched here, on the decoded text)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class Sample:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""                      # text sent so far
    finish_reason: str | None = None


class Decoding:
    def __init__(self, tokenizer: Any, n: int, stop: list[str]) -> None:
        self.decode = tokenizer.decode if tokenizer is not None else None
        self.stop = stop
        self.samples = [Sample() for _ in range(n)]

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
        full = self.decode(s.token_ids)
        cut = self._stop_at(full, len(s.text))
        if cut is not None:
            full, s.finish_reason = full[:cut], "stop"
        elif not final:
            full = full[:len(full) - self._held(full)]
        delta = full[len(s.text):] if full.startswith(s.text) else ""
        s.text += delta
        return new_ids, delta

    def _held(self, text: str) -> int:
        """Characters to hold back: a maybe-partial UTF-8 character, or the start of a stop string."""
        held = max((k for x in self.stop for k in range(1, len(x)) if text.endswith(x[:k])), default=0)
        return max(held, 1 if text.endswith(REPLACEMENT) else 0)

    def _stop_at(self, text: str, sent: int) -> int | None:
        start = max(0, sent - max((len(x) for x in self.stop), default=0))
        hits = [p for p in (text.find(x, start) for x in self.stop) if p >= 0]
        return min(hits) if hits else None

    def finish(self, i: int, reason: str | None) -> None:
        s = self.samples[i]
        if s.finish_reason is None:
            s.finish_reason = reason
