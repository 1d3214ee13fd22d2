"""The pool's trust boundary (docs/security.md): a name squatted by another user is refused before anything of it
is mapped, the pool serves no joiner of another user, and its memfds are sealed so that no member can shrink them
under the others (a shrink would SIGBUS every member touching the lost pages)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from helpers import other_user

from kvlab.common import memfd
from kvlab.vmm import pool
from kvlab.vmm.pool import enroll, rendezvous
from kvlab.vmm.pool.attachment import Attachment
from kvlab.vmm.pool.errors import PoolError
from kvlab.vmm.pool.ledger import Ledger, ledger_bytes

PAGE = 64 * 1024
ROOT = Path(__file__).resolve().parents[1]


def unique() -> str:
    return f"sec-{uuid.uuid4().hex[:10]}"


def mapped_or_open(name: str) -> int:
    """This process's descriptors and mappings of pool `name`'s memfds."""
    fds = [os.readlink(p) for p in Path("/proc/self/fd").iterdir() if _readable(p)]
    maps = Path("/proc/self/maps").read_text().splitlines()
    return sum(f"kvlab-pool-{name}-" in line for line in fds + maps)


def _readable(path: Path) -> bool:
    try:
        os.readlink(path)
        return True
    except OSError:
        return False


@pytest.fixture
def shared():
    other_user.skip_unless_possible()
    with other_user.shared_dir() as path:
        yield path


@pytest.fixture
def squatter(shared):
    """A uid-65534 process holding a pool name, answering joins with well-formed books and pages."""
    tmp_path = shared
    name, total = unique(), 16
    books = bytearray(ledger_bytes(total, enroll.MAX_ENGINES))
    Ledger.format(books, PAGE, total, enroll.MAX_ENGINES)
    (tmp_path / "books").write_bytes(bytes(books))
    (tmp_path / "books").chmod(0o644)
    count = tmp_path / "count"
    count.write_text("0")
    count.chmod(0o666)
    script = tmp_path / "squatter.py"
    script.write_text((ROOT / "tests/helpers/squatter.py").read_text())
    proc = other_user.start(script, name, str(tmp_path / "books"), str(total * PAGE), str(count))
    yield name
    other_user.stop(proc)


def test_a_join_refuses_a_pool_name_held_by_another_user(squatter):
    with pytest.raises(rendezvous.UntrustedPool, match="not trusted") as info:
        pool.join(squatter)
    assert "\n" not in str(info.value) and "uid 65534" in str(info.value)
    assert mapped_or_open(squatter) == 0                      # nothing of the squatter's was taken


def test_pool_status_says_a_squatted_name_is_not_trusted(squatter):
    cmd = [sys.executable, "-c", "from kvlab.experiments.cli.launch import main; raise SystemExit(main())",
           "pool", "status", squatter]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "not trusted" in lines[0] and "Traceback" not in done.stderr


JOINER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\\0kvlab-pool-" + sys.argv[1])
sock.settimeout(5)
print("ready", flush=True)
try:
    msg, fds, _, _ = socket.recv_fds(sock, 16, 70)
except OSError:
    msg, fds = b"", []
print(len(fds), flush=True)
"""


def test_a_pool_gives_nothing_to_a_joiner_of_another_user(shared):
    tmp_path, name = shared, unique()
    member = pool.create(name, 16 * PAGE)
    try:
        script = tmp_path / "joiner.py"
        script.write_text(JOINER)
        proc = other_user.start(script, name)
        try:
            assert proc.stdout.readline().strip() == "0"       # no descriptor crossed to uid 65534
        finally:
            other_user.stop(proc)
    finally:
        member.close()


def test_a_pools_memfds_cannot_be_resized():
    member = pool.create(unique(), 16 * PAGE)
    try:
        attachment = member._attachment
        for fd in (attachment.ledger_fd, attachment.pages_fd):
            size = os.fstat(fd).st_size
            for new in (size // 2, size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, new)
            assert os.fstat(fd).st_size == size
    finally:
        member.close()


def plain_memfd(nbytes: int) -> int:
    fd = os.memfd_create("kvlab-test-unsealed")
    os.ftruncate(fd, nbytes)
    return fd


@pytest.mark.parametrize("pages, why", [
    (lambda: plain_memfd(16 * PAGE), "not sealed"),
    (lambda: memfd.sealed("kvlab-test-short", 4 * PAGE), "expected"),
    (lambda: os.pipe()[0], "not a sealable memfd"),
])
def test_an_attachment_refuses_pages_it_could_not_map_safely(pages, why):
    name = unique()
    fds = [pages()]
    books = enroll.new_books(name, PAGE, 16, enroll.HOST, fds)
    with pytest.raises(PoolError, match=why) as info:
        Attachment(name, books, fds)
    assert "\n" not in str(info.value)


def serve_once(name: str, fds: list[int]) -> threading.Thread:
    """A same-user process's server answering one join with `fds` (as a member that shrank the pages would)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(rendezvous.address(name))
    server.listen(1)
    server.settimeout(10)

    def answer():
        with server:
            conn, _ = server.accept()
            with conn:
                socket.send_fds(conn, [rendezvous.HELLO], fds)
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_joining_a_pool_whose_pages_are_shorter_than_its_books_is_refused():
    name = unique()
    pages = plain_memfd(4 * PAGE)                  # the books say 16 pages
    books = enroll.new_books(name, PAGE, 16, enroll.HOST, [pages])
    thread = serve_once(name, [books, pages])
    with pytest.raises(PoolError, match="pages") as info:
        pool.join(name)
    thread.join(10)
    assert "\n" not in str(info.value)
    for fd in (books, pages):
        os.close(fd)
    assert mapped_or_open(name) == 0                # the joiner kept and mapped nothing


@pytest.mark.parametrize("nbytes, page_size", [(16 * PAGE + 0.5, PAGE), (16.0 * PAGE, PAGE), (16 * PAGE, None),
                                               ("1MiB", PAGE), (True, PAGE)])
def test_pool_sizes_that_are_not_integers_are_one_line_errors(nbytes, page_size):
    with pytest.raises(pool.LimitError, match="integer") as info:
        pool.create(unique(), nbytes, page_size=page_size)
    assert "\n" not in str(info.value)


def test_limits_that_are_not_integers_are_one_line_errors():
    with pool.create(unique(), 16 * PAGE) as member:
        with pytest.raises(pool.LimitError, match="integer"):
            pool.set_limits(member.name, member.engine, floor=1.5)
