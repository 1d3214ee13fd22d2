"""What a backend offers the handoff (`KVHandoff`), what one move reports (`HandoffReport`) and its outcomes.

The prefill side `export`s a held sequence's KV as a JSON-able header plus file descriptors (a memfd of copied K/V,
or none when the pages themselves change hands) and later `release`s the sequence, told whether the decode side
took the KV. The decode side `import_kv`s a header into a sequence's first allocation, or raises `HandoffRefused`
(nothing taken, the prefill side keeps and frees its KV) or another `HandoffError`. A backend's spec names its
factory (`BackendSpec.handoff`, "module:attribute"), called with the engine's KVCache and config.
"""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.common.errors import ConfigError, HandoffError

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence


class HandoffRefused(HandoffError):
    """The decode side took nothing (no room, its pool ceiling): the prefill side still owns the KV."""


class HandoffConflict(HandoffRefused):
    """The handoff was pulled already (a replay): a handoff is pulled once (HTTP 409 where it is served)."""


@dataclass(slots=True)
class HandoffReport:
    """One side's part of one handoff: wall seconds, K/V bytes it copied, units (pages, blocks, tokens) moved."""
    seconds: float
    bytes_copied: int
    units_moved: int
    unit: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Export:
    """What the prefill side sends: a header for the decode side's backend, descriptors to pass (SCM_RIGHTS, closed
    by the sender once sent), and its own report."""
    header: dict[str, Any]
    fds: list[int]
    report: HandoffReport


class KVHandoff(Protocol):
    unit: str
    import_within_ack: bool       # a header is imported only while the giver still waits for the ack (see side.py)

    def check_peer(self, header: dict[str, Any]) -> None:
        """Raise HandoffError if a KV header from the other side cannot go into this engine (layout, sizes)."""

    def describe(self) -> dict[str, Any]:
        """What the other side checks against its own (`check_peer`): the KV layout and unit size."""

    def params(self) -> dict[str, Any]:
        """The backend's own fields of a prefill answer's kv_transfer_params (vmm: its pool); common passes them
        through without reading them."""

    def check_params(self, kv: dict[str, Any]) -> None:
        """Decode side, as a request arrives: raise RequestError (one line) if the backend's own fields of its
        kv_transfer_params do not fit this engine."""

    def export(self, seq: Sequence, num_tokens: int) -> Export:
        """The first `num_tokens` tokens' KV of a held sequence, for another engine (prefill side, engine lock held)."""

    def import_kv(self, seq: Sequence, header: dict[str, Any], fds: list[int]) -> HandoffReport:
        """Allocate `seq` (its first allocation) holding the exported tokens, filled from `header`/`fds`."""

    def release(self, seq: Sequence, taken: bool | None) -> None:
        """Free a kept sequence after its handoff: `taken` True, False (refused), or None (unknown: the peer died
        or timed out). Engine thread."""


def load_handoff(cache: KVCache, config: Any) -> KVHandoff:
    """The handoff of the configured backend, through its spec (no backend named here)."""
    entry = config.spec.handoff
    if not entry:
        raise ConfigError(f"the {config.backend} backend has no KV handoff; kv_role prefill/decode needs one")
    module, _, attribute = entry.partition(":")
    return getattr(importlib.import_module(module), attribute)(cache, config)
