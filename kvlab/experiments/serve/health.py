"""Waiting for a server to come up: GET URL/health until it answers 200, within a deadline. Given the server's
process, its exit ends the wait at once instead of at the deadline. Either failure is one ServerNotReady line."""
from __future__ import annotations

import subprocess
import time

import httpx

from kvlab.common.errors import KvlabError

POLL_S = 0.1
PROBE_S = 2.0                  # one GET's own limit (a server that accepts but does not answer yet)


class ServerNotReady(KvlabError):
    """The server exited, or did not answer /health with 200, before the deadline."""


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Return once URL/health answers 200; ServerNotReady if `proc` exits first or `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url, min(PROBE_S, max(deadline - time.monotonic(), POLL_S))):
        if proc is not None and proc.poll() is not None:
            raise ServerNotReady(f"the server at {url} exited with {proc.returncode} before /health answered 200")
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"{url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(POLL_S)


def healthy(url: str, timeout_s: float = PROBE_S) -> bool:
    """One GET URL/health: did it answer 200?"""
    try:
        return httpx.get(url + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False
