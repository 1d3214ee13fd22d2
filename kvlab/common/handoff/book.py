"""The prefill side's books: sequences kept for a pull, the outcomes the server thread posts for the engine thread,
and the handoff counters of either role.

The engine's lock guards `kept` (the engine thread adds and releases, the server thread claims); outcomes cross
threads through a queue, so every release happens on the engine thread (HandoffRole.poll: each step, and poll_idle)."""
from __future__ import annotations

import collections
import queue
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.common.handoff.seam import HandoffReport
    from kvlab.common.sequence import Sequence


@dataclass(slots=True)
class HandoffStats:
    """Summed since the engine started: handoffs done (and their seconds, bytes copied, units moved), pulls that
    failed or were refused, and kept KV that nobody pulled in time."""
    count: int = 0
    bytes_copied: int = 0
    units_moved: int = 0
    seconds: float = 0.0
    failed: int = 0
    expired: int = 0

    def add(self, report: HandoffReport) -> None:
        self.count += 1
        self.bytes_copied += report.bytes_copied
        self.units_moved += report.units_moved
        self.seconds += report.seconds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Kept:
    seq: Sequence
    num_tokens: int
    deadline: float
    in_flight: bool = False


@dataclass(slots=True, frozen=True)
class Outcome:
    handoff_id: str
    taken: bool | None            # None: unknown (the decode side died or stopped answering)
    report: HandoffReport | None


REMEMBERED = 4096              # handoff ids claimed once, remembered to tell a replay from an unknown id


class KeptBook:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.kept: dict[str, Kept] = {}
        self.outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self.claimed: collections.deque[str] = collections.deque(maxlen=REMEMBERED)

    def was_claimed(self, handoff_id: Any) -> bool:
        """Pulled (or declined) before: a second pull is a replay."""
        return handoff_id in self.claimed

    def add(self, handoff_id: str, seq: Sequence, num_tokens: int) -> None:
        self.kept[handoff_id] = Kept(seq, num_tokens, time.monotonic() + self.timeout_s)

    def claim(self, handoff_id: Any) -> Kept | None:
        """The kept KV for a pull, marked in flight (it no longer expires), or None if there is none to pull."""
        kept = self.kept.get(handoff_id) if isinstance(handoff_id, str) else None
        if kept is None or kept.in_flight:
            return None
        kept.in_flight = True
        self.claimed.append(handoff_id)
        return kept

    def settle(self, outcome: Outcome) -> None:
        """From the server thread: the engine thread releases the KV at its next poll."""
        self.outcomes.put(outcome)

    def settled(self) -> list[tuple[Kept, Outcome]]:
        done = []
        while True:
            try:
                outcome = self.outcomes.get_nowait()
            except queue.Empty:
                return done
            done.append((self.kept.pop(outcome.handoff_id), outcome))

    def expired(self) -> list[Kept]:
        now = time.monotonic()
        gone = [h for h, k in self.kept.items() if not k.in_flight and k.deadline <= now]
        return [self.kept.pop(h) for h in gone]

    def drain(self) -> list[Kept]:
        """Everything still kept (the engine is closing)."""
        kept, self.kept = list(self.kept.values()), {}
        return kept
