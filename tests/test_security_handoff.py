"""The handoff's trust boundary (docs/security.md), against forged prefill engines (tests/helpers/fake_prefill.py):
a decode engine pulls only from a process of its own uid, checks every header field before use, fails a forged or
slow pull alone within its deadline, never takes pool pages from an engine that did not answer, refuses shared
memory it could not map safely, and a handoff is bound to its prompt and pulled once. A pending pull holds a worker,
never the engine: other requests run meanwhile, and an abort or a close cuts it short."""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import other_user

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.errors import ConfigError, HandoffError, RequestError
from kvlab.common.handoff import shm
from kvlab.common.handoff.copying import _nbytes
from kvlab.common.sampling_params import SamplingParams
from kvlab.vmm import pool

ROOT = Path(__file__).resolve().parents[1]
BASE = {"model": "tiny", "backend": "paged", "max_model_len": 256, "kv_cache_bytes": 8 << 20, "max_num_seqs": 4}
PROMPT = [1 + 3 * j % 200 for j in range(21)]
OTHER = [2 + 5 * j % 200 for j in range(21)]                # same length, other tokens ("Jello wordy")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
REMOTE = {"do_remote_decode": True}


@pytest.fixture
def engines():
    built = []

    def make(role: str, **overrides) -> Engine:
        built.append(Engine.from_config(make_config(**(BASE | {"kv_role": role} | overrides))))
        return built[-1]
    yield make
    for e in built:
        e.close()


def run(e: Engine, prompt=PROMPT, kv=None):
    e.add_request(prompt, GREEDY, kv_transfer_params=kv)
    outputs = []
    while e.has_unfinished():
        outputs += e.step().finished
    return outputs[0]


def test_a_decode_engine_pulls_only_from_its_handoff_peers(engines):
    """handoff_name fixes a prefill engine's address; a decode engine with handoff_peers pulls from those names
    only: kv_transfer_params naming any other address is a one-line 400-class error and nothing contacts it; a
    second engine (of any user) cannot take a name in use."""
    name = f"peer-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    expected = run(engines("colocated")).outputs[0].token_ids
    named, other = engines("prefill", handoff_name=name), engines("prefill")
    assert named.handoff.address == f"kvlab-handoff-{name}"
    decode = engines("decode", handoff_peers=[name])
    assert run(decode, kv=run(named, kv=REMOTE).kv_transfer_params).outputs[0].token_ids == expected
    kv = run(other, kv=REMOTE).kv_transfer_params
    with pytest.raises(RequestError, match="not a prefill engine this decode engine pulls from") as info:
        decode.add_request(PROMPT, GREEDY, kv_transfer_params=kv)
    assert "\n" not in str(info.value) and not decode.has_unfinished()
    assert other.handoff.stats.to_dict()["count"] == 0 and other.cache_stats().used_units == 2   # never contacted
    with pytest.raises(ConfigError, match="is taken") as taken:
        engines("prefill", handoff_name=name)
    assert "\n" not in str(taken.value)



def failed_alone(e: Engine, out, match: str) -> None:
    """The request failed in one line naming `match`, and the engine serves the next request."""
    assert out.outputs[0].finish_reason == "error" and out.error is not None, out.error
    assert match in out.error and "\n" not in out.error, out.error
    assert run(e).error is None


@pytest.fixture
def fakes():
    """Start forged prefill engines (as this user, or as uid 65534); each killed at teardown."""
    started, dirs = [], []

    def start(body: bytes, mode="answer", memfd_bytes=0, sealed=True, as_other_user=False, pace_s=None) -> str:
        folder = Path(dirs[-1] if dirs else "")
        if not dirs:
            ctx = other_user.shared_dir()
            folder = ctx.__enter__()
            dirs.append((ctx, folder))
        folder = dirs[0][1]
        answer = folder / f"answer-{len(started)}"
        answer.write_bytes(body)
        answer.chmod(0o644)
        script = folder / "fake_prefill.py"
        script.write_text((ROOT / "tests/helpers/fake_prefill.py").read_text())
        address = f"kvlab-handoff-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        args = (address, mode, str(answer), str(memfd_bytes), "1" if sealed else "0", str(pace_s or 2))
        if as_other_user:
            started.append(other_user.start(script, *args))
        else:
            script.chmod(0o644)
            started.append(other_user.started(["timeout", "60", sys.executable, str(script), *args]))
        return address
    yield start
    for proc in started:
        other_user.stop(proc)
    for ctx, _ in dirs:
        ctx.__exit__(None, None, None)


def forged_kv(address: str, backend: str = "paged", **extra) -> dict:
    return {"do_remote_prefill": True, "handoff_id": "ab12", "address": address, "num_tokens": len(PROMPT),
            "first_token_ids": [5], "backend": backend, **extra}


def paged_answer(decode: Engine, **change) -> tuple[bytes, int]:
    """A well-formed copy answer for PROMPT on `decode`'s layout (body, memfd bytes), with `change` applied."""
    backend = decode.handoff.backend
    n = len(PROMPT)
    units = backend.units(n)
    shape = backend.layout(units, n)
    nbytes = _nbytes(shape, backend.shape.cache_dtype)
    header = {"num_tokens": n, "units": units, "shape": list(shape), "bytes": nbytes} | change
    return json.dumps({"ok": True, "header": header}).encode(), nbytes


# -- who may answer a pull ------------------------------------------------------------------------------------------
def test_a_decode_engine_refuses_a_peer_of_another_user(engines, fakes):
    other_user.skip_unless_possible()
    decode = engines("decode")
    body, nbytes = paged_answer(decode)
    address = fakes(body, memfd_bytes=nbytes, as_other_user=True)
    failed_alone(decode, run(decode, kv=forged_kv(address)), "not trusted")


# -- what a header may hold ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    b'{"ok": true, "header": {"num_tokens": 1e400, "units": 2, "shape": [1], "bytes": 4}}',
    b'{"ok": true, "header": {"num_tokens": 21, "units": 1180591620717411303424, "shape": [1], "bytes": 4}}',
    b'{"ok": true, "header": {"num_tokens": 21, "units": 2, "shape": [1180591620717411303424], "bytes": 4}}',
    b'{"ok": true, "header": {"num_tokens": 21, "units": -1, "shape": [1], "bytes": 4}}',
    b'{"ok": true, "header": {"num_tokens": 20, "units": 2, "shape": [1], "bytes": 4}}',
    b'{"ok": true, "header": {"num_tokens": 21.0, "units": 2, "shape": [NaN], "bytes": 4}}',
    b'{"ok": true, "header": 5}',
    b'{"ok": true}',
    b'{"ok": "yes", "error": {"a": 1}}',
    b'[1, 2]',
    b'not json',
    b'[' * 100000,
], ids=lambda b: b[:40].decode())
def test_a_forged_header_fails_its_request_alone(engines, fakes, body):
    decode = engines("decode")
    _, nbytes = paged_answer(decode)
    out = run(decode, kv=forged_kv(fakes(body, memfd_bytes=nbytes)))
    failed_alone(decode, out, "")


def test_a_vmm_pull_takes_no_pages_of_an_engine_that_did_not_answer(engines, fakes):
    """A forged header naming a real prefill engine's slot, pid and pages: the pages stay that engine's."""
    with pool.create(f"sec-{uuid.uuid4().hex[:10]}", 8 << 20, page_size=4096) as holder:
        vmm = {"backend": "vmm", "page_size": 4096, "kv_pool": holder.name}
        prefill, decode = engines("prefill", **vmm), engines("decode", **vmm)
        run(prefill, kv=REMOTE)                         # its KV is kept: pages the prefill engine holds
        giver = prefill.handoff.backend.member.index
        with holder._attachment.locked() as ledger:
            pages = ledger.pages_of(giver).tolist()
        geo = decode.handoff.backend.geo
        n_pages = geo.pages_for(len(PROMPT)) * geo.num_tensors
        header = {"num_tokens": len(PROMPT), "giver": giver, "giver_pid": os.getpid(), "pages": pages[:n_pages]}
        address = fakes(json.dumps({"ok": True, "header": header}).encode())
        out = run(decode, kv=forged_kv(address, "vmm", pool=holder.name))
        failed_alone(decode, out, "giver")
        with holder._attachment.locked() as ledger:
            assert ledger.pages_of(giver).tolist() == pages            # nothing changed owner


def test_a_vmm_header_with_page_ids_past_any_pool_fails_alone(engines, fakes):
    with pool.create(f"sec-{uuid.uuid4().hex[:10]}", 8 << 20, page_size=4096) as holder:
        vmm = {"backend": "vmm", "page_size": 4096, "kv_pool": holder.name}
        decode = engines("decode", **vmm)
        backend = decode.handoff.backend
        count = backend.geo.pages_for(len(PROMPT)) * backend.geo.num_tensors        # as many as expected
        header = {"num_tokens": len(PROMPT), "giver": 0, "giver_pid": 1, "pages": [2**70] * count}
        body = json.dumps({"ok": True, "header": header}).encode()
        failed_alone(decode, run(decode, kv=forged_kv(fakes(body), "vmm", pool=holder.name)), "out of range")


# -- how long a peer may take -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_silent_or_trickling_peer_fails_its_request_within_the_deadline(engines, fakes, mode):
    decode = engines("decode", handoff_timeout_s=1.0)              # the pull's deadline: 1 s
    body, nbytes = paged_answer(decode)
    address = fakes(body, mode=mode, memfd_bytes=nbytes, pace_s=0.3)   # a byte well within any per-read timeout
    start = time.monotonic()
    out = run(decode, kv=forged_kv(address))
    assert time.monotonic() - start < 4.0
    failed_alone(decode, out, "deadline" if mode == "trickle" else "")


def pending_pull(decode: Engine, address: str, request_id: str = "forged"):
    """Queue a forged request naming `address` and step until its pull is on a worker; its ticket."""
    decode.add_request(PROMPT, GREEDY, request_id=request_id, kv_transfer_params=forged_kv(address))
    decode.step()
    ticket = decode.scheduler.requests[request_id].kv_import.ticket
    assert ticket is not None and not ticket.future.done()
    return ticket


def test_a_plain_request_runs_while_a_forged_pull_is_pending(engines, fakes):
    """The pull's network part runs on a worker (common/handoff/puller.py): a plain request queued behind a forged one
    whose peer never answers completes while that pull is still pending, and the forged one fails alone, in one
    line, at the pull's deadline."""
    decode = engines("decode", handoff_timeout_s=3.0)              # the pull's deadline: 3 s
    body, nbytes = paged_answer(decode)
    ticket = pending_pull(decode, fakes(body, mode="silent", memfd_bytes=nbytes))
    decode.add_request(PROMPT, GREEDY, request_id="plain")
    done = {}
    while "plain" not in done:
        done |= {out.request_id: out for out in decode.step().finished}
    assert not ticket.future.done() and decode.handoff.pulling(), "the plain request waited for the forged pull"
    assert done["plain"].error is None and len(done["plain"].outputs[0].token_ids) == GREEDY.max_tokens
    start = time.monotonic()
    while decode.has_unfinished():
        done |= {out.request_id: out for out in decode.step().finished}
    assert time.monotonic() - start < 3.0 + 2.0
    assert "answer" in done["forged"].error and "\n" not in done["forged"].error, done["forged"].error
    assert decode.handoff.stats.to_dict()["failed"] == 1 and not decode.handoff.pulling()


def test_aborting_a_request_cuts_its_pending_pull(engines, fakes):
    decode = engines("decode")
    body, nbytes = paged_answer(decode)
    ticket = pending_pull(decode, fakes(body, mode="silent", memfd_bytes=nbytes))
    assert decode.abort("forged")
    ticket.future.exception(timeout=2.0)                            # the worker returns at once, not at the deadline
    assert ticket.sock.fileno() == -1 and not decode.handoff.pulling()
    assert run(decode).error is None


def test_a_silent_peer_cannot_delay_engine_close(engines, fakes):
    """Close shuts every pending pull's socket: it waits for no peer, let alone for the pull's deadline."""
    from kvlab.common.handoff.side import PULL_DEADLINE_S
    decode = engines("decode")
    body, nbytes = paged_answer(decode)
    address = fakes(body, mode="silent", memfd_bytes=nbytes)
    tickets = [pending_pull(decode, address, f"forged-{i}") for i in range(3)]
    start = time.monotonic()
    decode.close()
    assert time.monotonic() - start < PULL_DEADLINE_S
    assert all(t.future.done() and t.sock.fileno() == -1 for t in tickets)


# -- shared memory a peer passes ---------------------------------------------------------------------------------------
def test_a_copy_handoff_memfd_cannot_be_resized():
    fd = shm.create(1 << 16)
    try:
        for size in (0, 1 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("sealed, short, match", [(False, False, "not sealed"), (True, True, "expected")])
def test_kv_memory_that_could_shrink_or_is_short_is_refused_before_mapping(engines, fakes, sealed, short, match):
    decode = engines("decode")
    body, nbytes = paged_answer(decode)
    address = fakes(body, memfd_bytes=nbytes // 2 if short else nbytes, sealed=sealed)
    failed_alone(decode, run(decode, kv=forged_kv(address)), match)


# -- what a handoff is bound to ---------------------------------------------------------------------------------------
def test_a_handoff_is_bound_to_its_prompt(engines):
    prefill, decode = engines("prefill"), engines("decode")
    kv = run(prefill, kv=REMOTE).kv_transfer_params
    assert kv["prompt_hash"]
    failed_alone(decode, run(decode, OTHER, kv=kv), "another prompt")      # checked by the decode engine
    stripped = {k: v for k, v in kv.items() if k != "prompt_hash"}
    failed_alone(decode, run(decode, OTHER, kv=stripped), "another prompt")  # and by the prefill engine
    right = run(decode, PROMPT, kv=kv)
    assert right.error is None and right.outputs[0].token_ids[0] == kv["first_token_ids"][0]


def test_a_handoff_is_pulled_once(engines):
    prefill, decode = engines("prefill"), engines("decode")
    kv = run(prefill, kv=REMOTE).kv_transfer_params
    assert run(decode, kv=kv).error is None
    failed_alone(decode, run(decode, kv=kv), "pulled already")


def test_a_replay_is_a_conflict():
    from kvlab.common.handoff.seam import HandoffConflict, HandoffRefused
    assert issubclass(HandoffConflict, HandoffRefused) and issubclass(HandoffConflict, HandoffError)
