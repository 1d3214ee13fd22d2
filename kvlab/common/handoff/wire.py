"""Messages between the two sides: one JSON object per message, framed by an 8-byte length, with descriptors
attached to the length (SCM_RIGHTS) when there are any. Every socket has a timeout, so no read or write waits
forever; a timeout, a closed peer or a malformed message raises HandoffError."""
from __future__ import annotations

import json
import os
import socket
from typing import Any

from kvlab.common.errors import HandoffError

PREFIX = "kvlab-handoff-"
LENGTH = 8
MAX_MESSAGE = 64 << 20
MAX_FDS = 16


def socket_address(address: str) -> str:
    """The abstract socket name of a handoff address (which carries no leading NUL, so it stays JSON text)."""
    return "\0" + address


def connect(address: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_address(address))
    except OSError as exc:
        sock.close()
        raise HandoffError(f"cannot reach the prefill engine at {address} ({exc.strerror or exc}): it has "
                           "exited or the KV expired") from None
    return sock


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    body = json.dumps(message).encode()
    length = len(body).to_bytes(LENGTH, "little")
    try:
        if fds:
            sent = socket.send_fds(sock, [length], list(fds))
            if sent != LENGTH:
                raise HandoffError("a handoff message was cut short")
        else:
            sock.sendall(length)
        sock.sendall(body)
    except OSError as exc:
        raise HandoffError(f"the other engine stopped answering ({_why(exc)})") from None


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it (the caller closes them)."""
    fds: list[int] = []
    try:
        head, fds, _, _ = socket.recv_fds(sock, LENGTH, MAX_FDS)
        head += _exactly(sock, LENGTH - len(head))
        if len(head) < LENGTH:
            raise HandoffError("the other engine closed the connection")
        size = int.from_bytes(head, "little")
        if size > MAX_MESSAGE:
            raise HandoffError(f"a handoff message of {size} bytes is too large")
        message = json.loads(_exactly(sock, size))
    except (OSError, ValueError, HandoffError) as exc:
        close_all(fds)
        if isinstance(exc, HandoffError):
            raise
        raise HandoffError(f"the other engine stopped answering ({_why(exc)})") from None
    if not isinstance(message, dict):
        close_all(fds)
        raise HandoffError("a handoff message is not a JSON object")
    return message, fds


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left > 0:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise HandoffError("the other engine closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _why(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
