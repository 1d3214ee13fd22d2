"""Joining by name through a Linux abstract Unix socket, "\\0kvlab-pool-NAME": no file anywhere, and the name is
gone the moment its socket closes, its process's death included. Whichever member binds the name serves joins
by passing the pool's descriptors (socket.send_fds, SCM_RIGHTS: the books, then the memory) to processes of the
same user. Trust goes both ways (docs/security.md): the server answers only joiners of its uid, and a joiner takes
descriptors only from a server of its own uid, read from the kernel (SO_PEERCRED), so a name squatted by another
user is refused before anything of it is mapped."""
from __future__ import annotations

import errno
import os
import re
import socket
import struct
import time

from kvlab.vmm.pool.errors import PoolError, PoolExists, UnknownPool

PREFIX = "kvlab-pool-"
HELLO = b"kvlab-pool/2"          # 2: the books first, then one or more memory descriptors
MAX_MEMORY_FDS = 64              # a GPU pool's chunks (cuda_chunks.py); SCM_RIGHTS passes up to 253
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
JOIN_WAIT_S = 0.5     # longer than a steward handover (steward.py), so a join never falls into one
ANSWER_WAIT_S = 5.0


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise PoolError(f"bad pool name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")


def address(name: str) -> str:
    return "\0" + PREFIX + name


def listen(name: str) -> socket.socket | None:
    """The listening socket bound to the pool's name, or None when another process holds the name."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(address(name))
    except OSError as e:
        server.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise
    server.listen(64)
    return server


def claim(name: str) -> socket.socket:
    server = listen(name)
    if server is None:
        raise PoolExists(f"a pool named {name!r} already exists on this machine; join it or pick another name")
    return server


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class UntrustedPool(PoolError):
    """The process serving the name runs as another user: its books and memory are never taken."""


def check_server(name: str, sock: socket.socket) -> None:
    """The server of `name` must run as this process's uid (root trusts only root): the kernel's word, not the
    server's."""
    uid = peer_uid(sock)
    if uid != os.getuid():
        raise UntrustedPool(f"pool {name!r} is served by uid {uid}, not this user's ({os.getuid()}): not trusted, "
                            "nothing was taken from it (another user holds the name; pick another name)")


def serve_one(server: socket.socket, fds: list[int], wait_s: float) -> None:
    """Answer one join waiting at most `wait_s` for it; a peer of another user gets nothing."""
    server.settimeout(wait_s)
    try:
        conn, _ = server.accept()
    except (TimeoutError, BlockingIOError):       # BlockingIOError: wait_s was 0
        return
    with conn:
        conn.settimeout(ANSWER_WAIT_S)
        if peer_uid(conn) == os.getuid():
            try:
                socket.send_fds(conn, [HELLO], fds)
            except OSError:          # the joiner gave up or died: its loss alone
                pass


def _connect(name: str) -> socket.socket:
    deadline = time.monotonic() + JOIN_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address(name))
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            if time.monotonic() > deadline:
                raise UnknownPool(f"no pool named {name!r} on this machine (create it with "
                                  f"`kvlab pool create {name} --bytes N`)") from None
            time.sleep(0.02)


def fetch(name: str) -> tuple[int, list[int]]:
    """The pool's books and memory descriptors from whichever member serves the name."""
    check_name(name)
    with _connect(name) as sock:
        check_server(name, sock)
        sock.settimeout(ANSWER_WAIT_S)
        try:
            msg, fds, _, _ = socket.recv_fds(sock, len(HELLO), 1 + MAX_MEMORY_FDS, socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            raise PoolError(f"pool {name!r} did not answer the join within {ANSWER_WAIT_S:g} s") from None
        except OSError as exc:
            raise PoolError(f"pool {name!r} broke off the join ({exc.strerror or exc})") from None
    if msg != HELLO or len(fds) < 2:
        for fd in fds:
            os.close(fd)
        raise PoolError(f"pool {name!r} answered the join with something else ({msg[:32]!r})")
    return fds[0], fds[1:]
