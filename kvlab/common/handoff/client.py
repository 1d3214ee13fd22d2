"""The decode side's pull: connect to the prefill engine's address, ask for the KV, import it through the backend,
ack. Runs on the decode engine's thread (inside admission), with a timeout on every socket operation."""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import HandoffError
from kvlab.common.handoff.seam import HandoffRefused
from kvlab.common.handoff.wire import close_all, connect, receive, send

if TYPE_CHECKING:
    from kvlab.common.handoff.seam import HandoffReport, KVHandoff
    from kvlab.common.sequence import Sequence


def acknowledge(sock: socket.socket, taken: bool) -> None:
    """Tell the prefill side whether the KV was taken; it releases its side either way, so a lost ack only
    delays that (the prefill side reads the truth from its own books: vmm's pool ledger)."""
    try:
        send(sock, {"op": "ack", "taken": taken})
    except HandoffError:
        pass


def pull(kv: dict[str, Any], backend: KVHandoff, seq: Sequence, timeout_s: float) -> HandoffReport:
    """Import the KV named by `kv` into `seq`; the report's seconds cover the whole pull, both sides."""
    start = time.perf_counter()
    with connect(kv["address"], timeout_s) as sock:
        send(sock, {"op": "pull", "handoff_id": kv["handoff_id"], "layout": backend.describe()})
        answer, fds = receive(sock)
        try:
            if answer.get("ok") is False:
                raise HandoffRefused(f"the prefill engine refused the pull: {str(answer.get('error'))[:200]}")
            if answer.get("ok") is not True:
                raise HandoffError(f"a malformed answer from the prefill engine: {str(answer)[:120]}")
            report = backend.import_kv(seq, answer.get("header"), fds)
        except BaseException:
            acknowledge(sock, False)
            raise
        finally:
            close_all(fds)
        acknowledge(sock, True)
    report.seconds = time.perf_counter() - start
    return report


def decline(kv: dict[str, Any], timeout_s: float) -> None:
    """The request ended before needing the KV (its first token stopped it): let the prefill side free it now."""
    try:
        with connect(kv["address"], timeout_s) as sock:
            send(sock, {"op": "decline", "handoff_id": kv["handoff_id"]})
    except HandoffError:
        pass                                               # it expires on the prefill side instead
