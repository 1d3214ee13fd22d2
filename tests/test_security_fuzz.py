"""Fuzzers over the two wires another process speaks to an engine (docs/security.md): forged answers to a decode
engine's pull (headers, lengths, descriptors, timing) and forged or broken joins of a pool, from both ends. Each case
must end as a one-line refusal (or a success); afterwards the engine or pool answers the next valid request."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import socket
import threading
import uuid

import pytest

from kvlab.common import memfd
from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.errors import KvlabError
from kvlab.common.sampling_params import SamplingParams
from kvlab.vmm import pool
from kvlab.vmm.pool import rendezvous

PROMPT = [1 + 3 * j % 200 for j in range(21)]
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
ODD = [None, True, -1, 0, 1, 2**31, 2**63, 2**70, 1.5, float("nan"), "x" * 300, [], [1] * 50, {"a": 1}, [[1]]]


class ScriptedPeer:
    """A forged prefill engine in a thread: each connection gets the next (length, body, fds, delay) answer."""

    def __init__(self) -> None:
        self.address = f"kvlab-handoff-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.address)
        self.sock.listen(4)
        self.answer = (0, b"", [], 0.0)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                length, body, fds, delay = self.answer
                try:
                    conn.settimeout(2)
                    conn.recv(1 << 16)
                    threading.Event().wait(delay)
                    head = length.to_bytes(8, "little")
                    socket.send_fds(conn, [head], fds) if fds else conn.sendall(head)
                    conn.sendall(body)
                    conn.recv(1 << 16)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def mutated_answer(rng: random.Random, good: dict) -> tuple[int, bytes, list[int], float]:
    header = dict(good)
    for _ in range(rng.randint(0, 3)):
        key = rng.choice([*header, "giver_pid", "extra"])
        header[key] = rng.choice(ODD + [rng.randint(-5, 5000)])
    message = rng.choice([{"ok": True, "header": header}, {"ok": rng.choice(ODD), "header": header},
                          {"ok": False, "error": rng.choice(ODD), "conflict": rng.choice(ODD)}, rng.choice(ODD)])
    body = json.dumps(message).encode()
    if rng.random() < 0.15:
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    length = len(body)
    if rng.random() < 0.15:
        length = rng.choice([0, length + rng.randint(1, 100), 2**63, 2**64 - 1, 1 << 30])
    fds = []
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        size = rng.choice([0, 1, 4096, good["bytes"], good["bytes"] // 2, 1 << 22])
        fd = memfd.sealed("kvlab-fuzz", size) if rng.random() < 0.7 else os.memfd_create("kvlab-fuzz")
        fds.append(fd)
    return length, body, fds, rng.choice([0.0, 0.0, 0.0, 0.01, 0.05])


def fuzz_handoff(cases: int, seed: int) -> None:
    decode = Engine.from_config(make_config(model="tiny", backend="paged", max_model_len=256, kv_cache_bytes=8 << 20,
                                            max_num_seqs=4, kv_role="decode", handoff_timeout_s=0.5))
    peer = ScriptedPeer()
    try:
        backend = decode.handoff.backend
        units = backend.units(len(PROMPT))
        shape = backend.layout(units, len(PROMPT))
        nbytes = 4 * math.prod(shape)
        good = {"num_tokens": len(PROMPT), "units": units, "shape": list(shape), "bytes": nbytes}
        rng = random.Random(seed)
        kv = {"do_remote_prefill": True, "handoff_id": "f", "address": peer.address, "num_tokens": len(PROMPT),
              "first_token_ids": [5], "backend": "paged"}
        for case in range(cases):
            peer.answer = mutated_answer(rng, good)
            decode.add_request(PROMPT, GREEDY, kv_transfer_params=kv)
            while decode.has_unfinished():
                for out in decode.step().finished:
                    assert out.error is None or "\n" not in out.error, (case, out.error)
            for fd in peer.answer[2]:
                os.close(fd)
        decode.add_request(PROMPT, GREEDY)
        outs = []
        while decode.has_unfinished():
            outs += decode.step().finished
        assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        peer.close()
        decode.close()


def test_forged_pull_answers_fail_alone_fast():
    fuzz_handoff(30, seed=1)


@pytest.mark.slow
def test_forged_pull_answers_fail_alone():
    fuzz_handoff(200, seed=2)


def junk_join_answer(rng: random.Random) -> tuple[bytes, list[int]]:
    hello = rng.choice([rendezvous.HELLO, b"", b"kvlab-pool/1", bytes(rng.randrange(256) for _ in range(12))])
    fds = []
    for _ in range(rng.choice([0, 1, 2, 2, 3])):
        kind = rng.random()
        if kind < 0.2:
            r, w = os.pipe()
            os.close(w)
            fds.append(r)
            continue
        size = rng.choice([0, 1, 64, 4096, 1 << 16, 1 << 20])
        fd = memfd.sealed("kvlab-fuzz", size) if kind < 0.7 else os.memfd_create("kvlab-fuzz")
        if rng.random() < 0.5 and size:
            os.pwrite(fd, bytes(rng.randrange(256) for _ in range(min(size, 256))), 0)
        fds.append(fd)
    return hello, fds


def fuzz_join(cases: int, seed: int) -> None:
    rng = random.Random(seed)
    for case in range(cases):
        name = f"fuzz-{uuid.uuid4().hex[:10]}"
        hello, fds = junk_join_answer(rng)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(rendezvous.address(name))
        server.listen(1)

        def answer(server=server, hello=hello, fds=fds):
            with server:
                conn, _ = server.accept()
                with conn:
                    socket.send_fds(conn, [hello], fds) if fds else conn.sendall(hello)
        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        try:
            pool.join(name).close()
        except KvlabError as exc:
            assert "\n" not in str(exc), (case, str(exc))
        thread.join(5)
        for fd in fds:
            os.close(fd)
    # and a live pool survives junk from joiners: bytes sent, early closes, idle connections
    with pool.create(f"fuzz-{uuid.uuid4().hex[:10]}", 1 << 20) as holder:
        for _ in range(cases // 4):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(rendezvous.address(holder.name))
            if rng.random() < 0.5:
                junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):   # the holder may hang up first
                    sock.sendall(junk)
            sock.close()
        joined = pool.join(holder.name)
        assert joined.status().total == 16
        joined.close()


def test_junk_join_answers_are_one_line_refusals_fast():
    fuzz_join(40, seed=3)


@pytest.mark.slow
def test_junk_join_answers_are_one_line_refusals():
    fuzz_join(200, seed=4)
