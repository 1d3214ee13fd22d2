"""The prefill side's server: an abstract Unix socket (`\\0kvlab-handoff-PID-RANDOM`, nothing in the filesystem)
served by one thread, one short-lived thread per pull. A pull claims the kept KV and exports it under the engine's
lock, sends the header (and descriptors), waits for the decode side's ack and posts the outcome; the engine thread
releases the KV. Only peers of the same user are served (SO_PEERCRED); a pull must name the kept sequence's prompt
(its prompt_hash), and a handoff is pulled once: a replay is answered as a conflict (docs/security.md)."""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import ConfigError, HandoffError
from kvlab.common.handoff.book import Outcome
from kvlab.common.handoff.params import prompt_hash
from kvlab.common.handoff.wire import PREFIX, close_all, peer, receive, send, socket_address

if TYPE_CHECKING:
    from kvlab.common.handoff.book import KeptBook
    from kvlab.common.handoff.seam import Export, KVHandoff

ACCEPT_POLL_S = 0.2
log = logging.getLogger("kvlab.handoff")


def await_ack(conn: socket.socket) -> bool | None:
    """The decode side's answer: True (taken), False (refused), None (it died or stopped answering)."""
    try:
        ack, fds = receive(conn)
    except HandoffError:
        return None
    close_all(fds)
    return ack.get("taken") is True


class HandoffServer:
    def __init__(self, book: KeptBook, backend: KVHandoff, lock: threading.RLock, io_timeout_s: float,
                 name: str | None = None) -> None:
        """`name`: serve at kvlab-handoff-NAME (decode engines may list it in handoff_peers), else a random name."""
        self.book, self.backend, self.lock, self.io_timeout_s = book, backend, lock, io_timeout_s
        self.address = f"{PREFIX}{name or f'{os.getpid()}-{secrets.token_hex(8)}'}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(socket_address(self.address))
        except OSError:
            self.sock.close()
            if name is None:
                raise
            raise ConfigError(f"handoff name {name!r} is taken: another process (of this or another user) serves "
                              f"at {self.address}") from None
        self.sock.listen(64)
        self.sock.settimeout(ACCEPT_POLL_S)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="kvlab-handoff", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return                                     # closed
            threading.Thread(target=self._handle, args=(conn,), name="kvlab-handoff-pull", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.io_timeout_s)
            try:
                if peer(conn)[1] != os.getuid():
                    return
                request, fds = receive(conn)
            except (HandoffError, OSError):
                return
            close_all(fds)
            if request.get("op") == "decline":
                self._decline(request.get("handoff_id"))
            elif request.get("op") == "pull":
                self._pull(conn, request)

    def _decline(self, handoff_id: Any) -> None:
        with self.lock:
            kept = self.book.claim(handoff_id)
        if kept is not None:
            self.book.settle(Outcome(handoff_id, False, None))

    def _pull(self, conn: socket.socket, request: dict[str, Any]) -> None:
        handoff_id = request.get("handoff_id")
        export, why = self._export(handoff_id, request.get("layout"), request.get("prompt_hash"))
        if export is None:
            return _refuse(conn, why, conflict=self.book.was_claimed(handoff_id))
        taken = None
        try:
            send(conn, {"ok": True, "header": export.header, "ack_s": self.io_timeout_s}, export.fds)
            taken = await_ack(conn)
        except HandoffError:
            pass
        finally:
            close_all(export.fds)
            self.book.settle(Outcome(handoff_id, taken, export.report if taken else None))

    def _export(self, handoff_id: Any, layout: Any, digest: Any) -> tuple[Export | None, str]:
        """Claim and export the kept KV under the engine's lock, or say why not. A pull for another prompt claims
        nothing (the KV stays for its own request); a failed export settles at once, so the KV is released (never
        left in flight)."""
        with self.lock:
            if self.book.was_claimed(handoff_id):
                return None, f"handoff {str(handoff_id)[:64]!r} was pulled already: a handoff is pulled once"
            waiting = self.book.kept.get(handoff_id) if isinstance(handoff_id, str) else None
            if waiting is not None and digest != prompt_hash(waiting.seq.token_ids[:waiting.num_tokens]):
                return None, (f"handoff {handoff_id[:64]!r} was computed for another prompt: send the prompt "
                              "the prefill engine computed")
            kept = self.book.claim(handoff_id)
            if kept is None:
                return None, (f"no KV is kept for handoff {str(handoff_id)[:64]!r}: it was taken, expired "
                              "(handoff_timeout_s) or never offered")
            try:
                self.backend.check_peer(layout)
                return self.backend.export(kept.seq, kept.num_tokens), ""
            except Exception as exc:       # noqa: BLE001 - whatever failed, the KV must not stay claimed
                if not isinstance(exc, (HandoffError, OSError)):
                    log.exception("handoff %s: the export failed", handoff_id)
                self.book.settle(Outcome(handoff_id, False, None))
                return None, str(exc) or type(exc).__name__

    def close(self) -> None:
        self.stopping.set()
        self.sock.close()
        self.thread.join(timeout=5 * ACCEPT_POLL_S)


def _refuse(conn: socket.socket, why: str, conflict: bool = False) -> None:
    try:
        send(conn, {"ok": False, "error": why, "conflict": conflict})
    except HandoffError:
        pass                                               # the puller is gone: nothing to tell

