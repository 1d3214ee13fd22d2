"""The decode side's network work, off the engine thread: a small fixed pool of worker threads runs each pull's
exchange (`client.fetch`) and each decline, so a silent or slow prefill engine holds a worker, never the engine
(docs/security.md). The engine thread starts a pull (`start`, only when a worker is free), reads its ticket at each
admission, and imports what arrived itself (`client.Fetched.take`). An abort or close cuts a pull short: its socket
is shut down, and whatever had arrived is dropped (ack False, descriptors closed)."""
from __future__ import annotations

import concurrent.futures
import socket
import threading
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import HandoffError
from kvlab.common.handoff import client

if TYPE_CHECKING:
    from kvlab.common.handoff.client import Fetched

WORKERS = 4                    # pulls in flight at once; more wait for a free worker (admission passes them over)
MAX_DECLINES = 64              # declines queued at once; more are skipped (the KV expires on the prefill side)


class Ticket:
    """One pull on a worker: its future, and its socket while connected, so `cancel` can end the wait."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.cancelled = False
        self.future: concurrent.futures.Future | None = None

    def attach(self, sock: socket.socket) -> None:
        """Worker thread, once connected."""
        with self.lock:
            if self.cancelled:
                raise HandoffError("the pull was cancelled (the request was aborted or the engine closed)")
            self.sock = sock

    def result(self) -> Fetched | None:
        """The answer, None while in flight; raises the pull's HandoffError."""
        if not self.future.done():
            return None
        return self.future.result()

    def cancel(self) -> None:
        """Shut the socket (a waiting worker returns at once) and drop whatever arrives or arrived."""
        with self.lock:
            self.cancelled = True
            if self.sock is not None:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass                                   # closed already
        self.future.add_done_callback(_drop)


def _drop(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().drop()


class Puller:
    def __init__(self, timeout_s: float, decline_timeout_s: float, workers: int = WORKERS) -> None:
        self.timeout_s, self.decline_timeout_s, self.workers = timeout_s, decline_timeout_s, workers
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvlab-pull")
        self.live: set[Ticket] = set()                     # started, not yet forgotten (engine thread only)
        self.declines = 0                                  # queued or running
        self.lock = threading.Lock()
        self.ended = threading.Condition()                 # notified as each pull ends

    def in_flight(self) -> int:
        return sum(not t.future.done() for t in self.live)

    def can_start(self) -> bool:
        return self.in_flight() < self.workers

    def start(self, kv: dict[str, Any], layout: dict[str, Any], digest: str, ack_window_s: float) -> Ticket:
        ticket = Ticket()
        ticket.future = self.pool.submit(client.fetch, kv, layout, digest, self.timeout_s, ack_window_s,
                                         ticket.attach)
        ticket.future.add_done_callback(self._ended)
        self.live.add(ticket)
        return ticket

    def forget(self, ticket: Ticket) -> None:
        """The engine is done with this pull (imported, failed or aborted): drop what it did not take."""
        self.live.discard(ticket)
        ticket.cancel()

    def wait(self, timeout_s: float) -> None:
        """Until a pull ends (or `timeout_s`), when there are pulls in flight and none ended unread."""
        with self.ended:
            self.ended.wait_for(lambda: not self.live or any(t.future.done() for t in tuple(self.live)), timeout_s)

    def _ended(self, _: concurrent.futures.Future) -> None:
        with self.ended:
            self.ended.notify_all()

    def decline(self, kv: dict[str, Any]) -> None:
        """Tell the prefill engine, from a worker, that its KV is not needed (fire and forget)."""
        with self.lock:
            if self.declines >= MAX_DECLINES:
                return
            self.declines += 1
        try:
            self.pool.submit(self._decline, kv)
        except RuntimeError:                               # closed
            self._declined()

    def _decline(self, kv: dict[str, Any]) -> None:
        try:
            client.decline(kv, self.decline_timeout_s)
        finally:
            self._declined()

    def _declined(self) -> None:
        with self.lock:
            self.declines -= 1

    def close(self) -> None:
        """Cut every pull short and wait for the workers: each task ends within its own deadline (a connect to a
        peer whose backlog is full is the only wait a shutdown cannot cut)."""
        for ticket in list(self.live):
            self.forget(ticket)
        self.pool.shutdown(wait=True, cancel_futures=True)
