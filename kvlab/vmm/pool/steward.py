"""Every member runs a steward thread. While this process holds the pool's name it serves joins and, every
`interval` seconds, returns dead engines' pages; otherwise it tries to bind the name every `interval`, so when the
serving process dies another member takes over within one interval. A dead engine's pages are therefore back
within two intervals while any member lives (one for the takeover, one for the reap). Each round the steward also
lets its engine answer other engines' requests for pages (`on_wanted`, the elastic protocol: docs/pool.md)."""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from kvlab.vmm.pool import rendezvous
from kvlab.vmm.pool.attachment import Attachment

REAP_INTERVAL_S = 0.1
log = logging.getLogger("kvlab.pool")


class Steward:
    def __init__(self, attachment: Attachment, own_slot: int, server: socket.socket | None = None,
                 interval: float = REAP_INTERVAL_S) -> None:
        self.attachment, self.own_slot, self.interval = attachment, own_slot, interval
        self.server = server
        self.on_wanted: Callable[[int], None] | None = None    # the engine's answer when others want pages
        self.on_round: Callable[[], None] | None = None        # then, each round: publish what it could give
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvlab-pool-{attachment.name}", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        return self.server is not None

    def _run(self) -> None:
        next_reap = 0.0
        while not self._stop.is_set():
            self._answer_wanted()
            if self.server is None:
                self.server = rendezvous.listen(self.attachment.name)
            if self.server is None:
                self._stop.wait(self.interval)
                continue
            rendezvous.serve_one(self.server, self.attachment.descriptors,
                                 max(0.0, next_reap - time.monotonic()))
            if time.monotonic() >= next_reap:
                self._reap()
                next_reap = time.monotonic() + self.interval

    def _answer_wanted(self) -> None:
        """Engines were refused pages: let this engine give back what it holds without need. The count is read
        without the lock (a hint); the answer takes the locks it needs."""
        wanted = int(self.attachment.ledger.header["wanted"])
        try:
            if wanted and self.on_wanted is not None:
                self.on_wanted(wanted)
            if self.on_round is not None:
                self.on_round()
        except Exception:               # never kill the steward: joins and reaping must go on
            log.exception("pool %s: giving pages back failed", self.attachment.name)

    def _reap(self) -> None:
        with self.attachment.locked() as ledger:
            if self.attachment.reap(ledger, self.own_slot):
                log.info("pool %s: returned the pages of dead engines", self.attachment.name)

    def stop(self) -> None:
        """Stop within one interval and give up the name."""
        self._stop.set()
        self._thread.join()
        if self.server is not None:
            self.server.close()
            self.server = None
