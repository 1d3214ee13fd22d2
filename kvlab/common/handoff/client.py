"""The decode side's pull, in two parts. `fetch` (a worker thread, common/handoff/puller.py): connect to the prefill
engine's address, check who answers (same uid, from the kernel), ask for the KV of this prompt, check the header;
the exchange has one deadline, so a silent or trickling peer costs a worker at most that, never the engine
(docs/security.md). `Fetched.take` (the engine thread, at admission): import through the backend, ack. Whatever
goes wrong is a one-line HandoffError: the request fails alone."""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import HandoffError
from kvlab.common.handoff.seam import HandoffConflict, HandoffRefused
from kvlab.common.handoff.wire import close_all, connect, peer, receive, send

if TYPE_CHECKING:
    from kvlab.common.handoff.seam import HandoffReport, KVHandoff
    from kvlab.common.sequence import Sequence

MAX_FIELD = 1 << 48            # any number in a KV header (tokens, pages, bytes, pids) is a smaller integer
MAX_LIST = 1 << 22             # and any list of them shorter
ACK_TIMEOUT_S = 0.0            # the ack never waits (the engine thread sends it): a peer that reads nothing loses it
log = logging.getLogger("kvlab.handoff")


def acknowledge(sock: socket.socket, taken: bool) -> None:
    """Tell the prefill side whether the KV was taken; it releases its side either way, so a lost ack only
    delays that (the prefill side reads the truth from its own books: vmm's pool ledger)."""
    try:
        sock.settimeout(ACK_TIMEOUT_S)
        send(sock, {"op": "ack", "taken": taken})
    except (HandoffError, OSError):
        pass


def check_peer(sock: socket.socket, address: str) -> int:
    """The pid of the prefill engine at `address`, if it runs as this engine's user; else HandoffError."""
    pid, uid = peer(sock)
    if uid != os.getuid():
        raise HandoffError(f"the process at {address} runs as uid {uid}, not this engine's ({os.getuid()}): "
                           "not trusted, nothing pulled")
    return pid


def checked_header(header: Any, num_tokens: int, peer_pid: int) -> dict[str, Any]:
    """The header, if every field is a non-negative integer (or a short list of them) below MAX_FIELD, it is for
    `num_tokens` tokens and any giving process it names is the one answering (vmm's `giver_pid`: no peer gives
    pages of another engine)."""
    if not isinstance(header, dict) or len(header) > 16:
        raise HandoffError(f"a malformed KV header from the prefill engine: {str(header)[:120]}")
    for key, value in header.items():
        values = value if isinstance(value, list) and len(value) <= MAX_LIST else [value]
        if not all(type(v) is int and 0 <= v < MAX_FIELD for v in values):
            raise HandoffError(f"KV header field {str(key)[:32]!r} is out of range: {str(value)[:60]}")
    if header.get("num_tokens") != num_tokens:
        raise HandoffError(f"the KV header is for {str(header.get('num_tokens'))[:20]} tokens, the request's "
                           f"prompt has {num_tokens}")
    if "giver_pid" in header and header["giver_pid"] != peer_pid:
        raise HandoffError(f"the KV header names pid {header['giver_pid']} as the giver, but pid {peer_pid} "
                           "answered: refused")
    return header


@dataclass(slots=True, eq=False)
class Fetched:
    """A prefill engine's checked answer, the connection still open for the ack. `ack_window_s`: how long the prefill
    side waits for that ack after sending (the answer's `ack_s`, at most IO_TIMEOUT_S; ours when it names none)."""
    sock: socket.socket
    header: dict[str, Any]
    fds: list[int]
    started: float                 # time.perf_counter() as the pull began
    received: float                # time.monotonic() as the answer arrived
    ack_window_s: float
    closed: bool = False

    def fresh(self, fraction: float) -> bool:
        """Whether less than `fraction` of the ack window has passed since the answer arrived."""
        return time.monotonic() < self.received + fraction * self.ack_window_s

    def take(self, backend: KVHandoff, seq: Sequence) -> HandoffReport:
        """Import the KV into `seq` and ack; the report's seconds cover the whole pull, both sides."""
        try:
            report = backend.import_kv(seq, self.header, self.fds)
        except HandoffError:
            self.drop()
            raise
        except Exception as exc:     # noqa: BLE001 - a peer's answer must fail its request, never the engine
            self.drop()
            log.warning("a pull failed outside the expected errors", exc_info=True)
            raise HandoffError(f"the KV pull failed ({type(exc).__name__}: {str(exc)[:120]})") from None
        self._close(True)
        report.seconds = time.perf_counter() - self.started
        return report

    def drop(self) -> None:
        """Nothing taken: ack False, close what came (idempotent; any thread)."""
        self._close(False)

    def _close(self, taken: bool) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            close_all(self.fds)
            acknowledge(self.sock, taken)
        finally:
            self.sock.close()


def fetch(kv: dict[str, Any], layout: dict[str, Any], digest: str, timeout_s: float, ack_window_s: float,
          attach: Callable[[socket.socket], None]) -> Fetched:
    """The prefill engine's answer for the KV named by `kv` (`digest`: this request's prompt_hash); `attach` is
    handed the connected socket (an abort or close shuts it down to end the wait)."""
    try:
        return _fetch(kv, layout, digest, timeout_s, ack_window_s, attach)
    except HandoffError:
        raise
    except Exception as exc:         # noqa: BLE001 - a peer's answer must fail its request, never the engine
        log.warning("a pull failed outside the expected errors", exc_info=True)
        raise HandoffError(f"the KV pull failed ({type(exc).__name__}: {str(exc)[:120]})") from None


def _fetch(kv: dict[str, Any], layout: dict[str, Any], digest: str, timeout_s: float, ack_window_s: float,
           attach: Callable[[socket.socket], None]) -> Fetched:
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    sock = connect(kv["address"], timeout_s)
    fds: list[int] = []
    try:
        attach(sock)
        peer_pid = check_peer(sock, kv["address"])
        send(sock, {"op": "pull", "handoff_id": kv["handoff_id"], "layout": layout, "prompt_hash": digest})
        answer, fds = receive(sock, deadline)
        received = time.monotonic()
        if answer.get("ok") is False:
            error = HandoffConflict if answer.get("conflict") is True else HandoffRefused
            raise error(f"the prefill engine refused the pull: {str(answer.get('error'))[:200]}")
        if answer.get("ok") is not True:
            raise HandoffError(f"a malformed answer from the prefill engine: {str(answer)[:120]}")
        header = checked_header(answer.get("header"), kv["num_tokens"], peer_pid)
    except BaseException:
        close_all(fds)
        acknowledge(sock, False)
        sock.close()
        raise
    return Fetched(sock, header, fds, start, received, _window(answer.get("ack_s"), ack_window_s))


def _window(value: Any, default: float) -> float:
    """The prefill side's ack wait as its answer states it (capped: a peer cannot widen ours), else `default`."""
    if type(value) in (int, float) and 0 < value <= default:
        return float(value)
    return default


def decline(kv: dict[str, Any], timeout_s: float) -> None:
    """The request ended before needing the KV (its first token stopped it): let the prefill side free it now."""
    try:
        with connect(kv["address"], timeout_s) as sock:
            check_peer(sock, kv["address"])
            send(sock, {"op": "decline", "handoff_id": kv["handoff_id"]})
    except HandoffError:
        pass                                               # it expires on the prefill side instead
