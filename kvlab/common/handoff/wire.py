"""Messages between the two sides: one JSON object per message, framed by an 8-byte length, with descriptors
attached to the length (SCM_RIGHTS) when there are any. Every socket has a timeout, so no read or write waits
forever, and a receive may also be given a deadline for the whole message (a peer trickling one byte at a time
then fails at the deadline, not per byte); a timeout, a closed peer or a malformed message raises HandoffError.
`peer` reads who is at the other end from the kernel (SO_PEERCRED), never from a message."""
from __future__ import annotations

import json
import os
import socket
import struct
import time
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


def peer(sock: socket.socket) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end, as the kernel recorded them at connect/listen."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


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


def receive(sock: socket.socket, deadline: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it (the caller closes them), whole by `deadline`
    (time.monotonic) if one is given."""
    fds: list[int] = []
    try:
        _wait_at_most(sock, deadline)
        head, fds, _, _ = socket.recv_fds(sock, LENGTH, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        head += _exactly(sock, LENGTH - len(head), deadline)
        if len(head) < LENGTH:
            raise HandoffError("the other engine closed the connection")
        size = int.from_bytes(head, "little")
        if size > MAX_MESSAGE:
            raise HandoffError(f"a handoff message of {size} bytes is too large")
        message = json.loads(_exactly(sock, size, deadline))
    except (OSError, ValueError, RecursionError, HandoffError) as exc:
        close_all(fds)
        if isinstance(exc, HandoffError):
            raise
        if deadline is not None and time.monotonic() >= deadline - 1e-3:
            raise HandoffError("the other engine did not answer within the handoff deadline") from None
        raise HandoffError(f"the other engine stopped answering ({_why(exc)})") from None
    if not isinstance(message, dict):
        close_all(fds)
        raise HandoffError("a handoff message is not a JSON object")
    return message, fds


def _wait_at_most(sock: socket.socket, deadline: float | None) -> None:
    """Cut the socket's timeout to what is left before `deadline`."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandoffError("the other engine did not answer within the handoff deadline")
    sock.settimeout(min(left, sock.gettimeout() or left))


def _exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks, left = [], n
    while left > 0:
        _wait_at_most(sock, deadline)
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
