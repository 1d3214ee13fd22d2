"""Run as another user by tests/test_security_pool.py: binds a pool's name first and answers every join with the
books and pages memfds it is given (well-formed books, sized pages), as a squatter would. Stdlib only.
argv: pool name, the books' bytes file, the pages' size in bytes, a file to count answered joins in."""
import fcntl
import os
import socket
import sys

name, books_file, pages_bytes, count_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]


def memfd(label, data=None, size=0):
    fd = os.memfd_create(label, os.MFD_ALLOW_SEALING)
    if data is not None:
        os.write(fd, data)
    else:
        os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


with open(books_file, "rb") as f:
    books = memfd(f"kvlab-pool-{name}-ledger", f.read())
pages = memfd(f"kvlab-pool-{name}-pages", size=pages_bytes)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("\0kvlab-pool-" + name)
server.listen(8)
print("ready", flush=True)
answered = 0
while True:
    conn, _ = server.accept()
    try:
        socket.send_fds(conn, [b"kvlab-pool/2"], [books, pages])
        answered += 1
    except OSError:
        pass
    conn.close()
    with open(count_file, "w") as out:
        out.write(str(answered))
