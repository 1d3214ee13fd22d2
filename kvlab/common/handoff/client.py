"""The decode side's pull: connect to the prefill engine's address, check who answers (same uid, from the kernel),
ask for the KV of this prompt, check the header, import it through the backend, ack. Runs on the decode engine's
thread (inside admission): the exchange up to the header has one deadline, so a silent or trickling peer costs at
most that (docs/security.md). Whatever goes wrong is a one-line HandoffError: the request fails alone."""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import HandoffError
from kvlab.common.handoff.params import prompt_hash
from kvlab.common.handoff.seam import HandoffConflict, HandoffRefused
from kvlab.common.handoff.wire import close_all, connect, peer, receive, send

if TYPE_CHECKING:
    from kvlab.common.handoff.seam import HandoffReport, KVHandoff
    from kvlab.common.sequence import Sequence

MAX_FIELD = 1 << 48            # any number in a KV header (tokens, pages, bytes, pids) is a smaller integer
MAX_LIST = 1 << 22             # and any list of them shorter
ACK_TIMEOUT_S = 1.0
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


def pull(kv: dict[str, Any], backend: KVHandoff, seq: Sequence, timeout_s: float) -> HandoffReport:
    """Import the KV named by `kv` into `seq`; the report's seconds cover the whole pull, both sides."""
    try:
        return _pull(kv, backend, seq, timeout_s)
    except HandoffError:
        raise
    except Exception as exc:         # noqa: BLE001 - a peer's answer must fail its request, never the engine
        log.warning("a pull failed outside the expected errors", exc_info=True)
        raise HandoffError(f"the KV pull failed ({type(exc).__name__}: {str(exc)[:120]})") from None


def _pull(kv: dict[str, Any], backend: KVHandoff, seq: Sequence, timeout_s: float) -> HandoffReport:
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    num_tokens = kv["num_tokens"]
    digest = prompt_hash(seq.token_ids[:num_tokens])
    if kv.get("prompt_hash", digest) != digest:
        raise HandoffError("kv_transfer_params belong to another prompt (prompt_hash differs): send the prompt the "
                           "prefill engine computed")
    with connect(kv["address"], timeout_s) as sock:
        peer_pid = check_peer(sock, kv["address"])
        send(sock, {"op": "pull", "handoff_id": kv["handoff_id"], "layout": backend.describe(),
                    "prompt_hash": digest})
        answer, fds = receive(sock, deadline)
        try:
            if answer.get("ok") is False:
                error = HandoffConflict if answer.get("conflict") is True else HandoffRefused
                raise error(f"the prefill engine refused the pull: {str(answer.get('error'))[:200]}")
            if answer.get("ok") is not True:
                raise HandoffError(f"a malformed answer from the prefill engine: {str(answer)[:120]}")
            header = checked_header(answer.get("header"), num_tokens, peer_pid)
            report = backend.import_kv(seq, header, fds)
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
            check_peer(sock, kv["address"])
            send(sock, {"op": "decline", "handoff_id": kv["handoff_id"]})
    except HandoffError:
        pass                                               # it expires on the prefill side instead
