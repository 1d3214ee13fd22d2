"""The handoff's contract inside one process (issue 30): a prefill engine and a decode engine side by side (the
prefill engine serves pulls from its own thread), the errors a caller can make, expiry, declines, and the pool
ledger's transfer step. Two-process runs and kill -9 faults are in tests/test_handoff_processes.py."""
from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.errors import ConfigError, DriverError, RequestError
from kvlab.common.sampling_params import SamplingParams
from kvlab.vmm import pool
from kvlab.vmm.pool.errors import PoolError
from kvlab.vmm.pool.transfer import TransferRefused, transfer

BASE = {"model": "tiny", "backend": "paged", "max_model_len": 256, "kv_cache_bytes": 8 << 20, "max_num_seqs": 4,
        "check_invariants": True}
PROMPT = [1 + 3 * j % 200 for j in range(21)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
REMOTE = {"do_remote_decode": True}


def engine(role: str, **overrides) -> Engine:
    return Engine.from_config(make_config(**(BASE | {"kv_role": role} | overrides)))


@pytest.fixture
def engines():
    built = []

    def make(role: str, **overrides) -> Engine:
        built.append(engine(role, **overrides))
        return built[-1]
    yield make
    for e in built:
        e.close()


def run(e: Engine, prompt=PROMPT, params=GREEDY, kv=None):
    e.add_request(prompt, params, kv_transfer_params=kv)
    outputs = []
    while e.has_unfinished():
        outputs += e.step().finished
    return outputs[0]


def settle(e: Engine, condition) -> dict:
    deadline = time.monotonic() + 30
    while not condition(stats := e.handoff.stats.to_dict()):
        assert time.monotonic() < deadline, stats
        e.handoff.poll_idle()
        time.sleep(0.01)
    return stats


def test_the_prefill_answer_carries_what_a_decode_engine_needs(engines):
    prefill = engines("prefill")
    out = run(prefill, kv=REMOTE)
    kv = out.kv_transfer_params
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    assert kv["do_remote_prefill"] is True and kv["address"] == prefill.handoff.address
    assert kv["num_tokens"] == len(PROMPT) and kv["first_token_ids"] == out.outputs[0].token_ids
    assert kv["backend"] == "paged" and "pool" not in kv and kv["handoff_id"]     # paged adds no fields of its own
    assert out.handoff == {"seconds": 0.0, "bytes_copied": 0, "units_moved": 0, "unit": "block"}
    assert prefill.cache_stats().used_units == 2 and not prefill.has_unfinished()     # kept, not running


def test_a_colocated_request_reports_no_handoff(engines):
    out = run(engines("colocated"))
    assert out.kv_transfer_params is None and out.handoff is None


def test_decode_output_is_the_whole_completion(engines):
    expected = run(engines("colocated")).outputs[0].token_ids
    prefill, decode = engines("prefill"), engines("decode")
    out = run(decode, kv=run(prefill, kv=REMOTE).kv_transfer_params)
    assert out.outputs[0].token_ids == expected and out.error is None
    assert out.handoff["unit"] == "block" and out.handoff["units_moved"] == 2
    assert out.handoff["bytes_copied"] == 2 * prefill.cache.storage.kv[:, :, 0].numel() * 4
    stats = settle(prefill, lambda s: s["count"] == 1)
    assert stats == decode.handoff.stats.to_dict() | {"seconds": stats["seconds"]}
    assert prefill.cache_stats().used_units == 0


def test_kv_nobody_pulls_expires(engines):
    prefill, decode = engines("prefill", handoff_timeout_s=0.05), engines("decode")
    kv = run(prefill, kv=REMOTE).kv_transfer_params
    settle(prefill, lambda s: s["expired"] == 1)
    assert prefill.cache_stats().used_units == 0
    late = run(decode, kv=kv)
    assert late.outputs[0].finish_reason == "error" and "expired" in late.error and "\n" not in late.error
    assert decode.handoff.stats.to_dict()["failed"] == 1


def test_a_decode_request_its_first_token_ends_declines_the_kv(engines):
    prefill, decode = engines("prefill"), engines("decode")
    kv = run(prefill, kv=REMOTE).kv_transfer_params
    out = run(decode, params=SamplingParams(max_tokens=1, temperature=0.0), kv=kv)
    assert out.outputs[0].token_ids == kv["first_token_ids"] and out.outputs[0].finish_reason == "length"
    stats = settle(prefill, lambda s: s["failed"] == 1)
    assert stats["count"] == 0 and prefill.cache_stats().used_units == 0


def test_an_aborted_decode_request_releases_the_kv_it_did_not_pull(engines):
    prefill, decode = engines("prefill"), engines("decode", max_num_seqs=1)
    decode.add_request(PROMPT, GREEDY)                         # takes the decode engine's only slot
    decode.step()
    decode.add_request(PROMPT, GREEDY, request_id="late", kv_transfer_params=run(prefill, kv=REMOTE).kv_transfer_params)
    decode.step()
    assert decode.abort("late")
    stats = settle(prefill, lambda s: s["failed"] == 1)
    assert stats["count"] == 0 and prefill.cache_stats().used_units == 0


def test_a_decode_request_refused_at_intake_declines_the_kv(engines):
    # a prompt + max_tokens this decode engine cannot take is refused before it is queued: the prefill engine
    # frees the KV at once instead of holding it for handoff_timeout_s
    prefill, decode = engines("prefill"), engines("decode", max_model_len=32)
    kv = run(prefill, kv=REMOTE).kv_transfer_params
    with pytest.raises(RequestError):
        decode.add_request(PROMPT, SamplingParams(max_tokens=100, temperature=0.0), kv_transfer_params=kv)
    stats = settle(prefill, lambda s: s["failed"] == 1)
    assert stats["count"] == 0 and prefill.cache_stats().used_units == 0


def test_kept_kv_holds_a_slot_until_released(engines):
    """max_num_seqs counts kept sequences (the KV they hold is real): the next request waits, not fails, until the
    kept KV is pulled."""
    prefill, decode = engines("prefill", max_num_seqs=1, max_num_batched_tokens=64), engines("decode")
    kv = run(prefill, kv=REMOTE).kv_transfer_params
    prefill.add_request(PROMPT, GREEDY)
    prefill.step()
    assert prefill.queue_depths() == (0, 1, 0)
    assert run(decode, kv=kv).error is None
    outputs = []
    while prefill.has_unfinished():
        outputs += prefill.step().finished
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_pull_of_another_backend_or_layout_fails_alone(engines):
    prefill, decode = engines("prefill"), engines("decode", block_size=32)
    kv = run(prefill, kv=REMOTE).kv_transfer_params
    out = run(decode, kv=kv)
    assert out.outputs[0].finish_reason == "error" and "layout" in out.error and "\n" not in out.error
    assert run(decode).error is None                                       # the engine keeps serving
    settle(prefill, lambda s: s["failed"] == 1)


def good_kv() -> dict:
    return {"do_remote_prefill": True, "handoff_id": "ab12", "address": "kvlab-handoff-1-ab", "num_tokens": len(PROMPT),
            "first_token_ids": [5], "backend": "paged", "pool": None}


@pytest.mark.parametrize("change, match", [
    ({"do_remote_prefill": False}, "do_remote_prefill"),
    ({"handoff_id": 7}, "handoff_id"),
    ({"address": "/tmp/sock"}, "not a kvlab handoff address"),
    ({"address": "kvlab-handoff-" + "x" * 200}, "address must be"),
    ({"num_tokens": 3}, "does not match the prompt"),
    ({"num_tokens": True}, "does not match the prompt"),
    ({"first_token_ids": []}, "list of one token id"),
    ({"first_token_ids": [10**9]}, "outside the vocabulary"),
    ({"backend": "vmm"}, "same backend"),
    ({"model": "smollm2-135m"}, "same model"),
])
def test_bad_decode_kv_transfer_params_are_one_line_errors(engines, change, match):
    decode = engines("decode")
    with pytest.raises(RequestError, match=match) as info:
        decode.add_request(PROMPT, GREEDY, kv_transfer_params=good_kv() | change)
    assert "\n" not in str(info.value)
    assert not decode.has_unfinished()


def test_a_vmm_decode_request_from_another_pool_is_a_one_line_error(engines):
    """vmm's own field of kv_transfer_params, its pool, is checked by vmm as the request arrives."""
    with pool.create(f"handoff-{os.getpid()}-{uuid.uuid4().hex[:8]}", 8 << 20, page_size=4096) as holder:
        vmm = {"backend": "vmm", "page_size": 4096, "kv_pool": holder.name}
        prefill, decode = engines("prefill", **vmm), engines("decode", **vmm)
        assert run(prefill, kv=REMOTE).kv_transfer_params["pool"] == holder.name
        for pool_name in ("gpu0", None):
            with pytest.raises(RequestError, match="same kv_pool") as info:
                decode.add_request(PROMPT, GREEDY, kv_transfer_params=good_kv() | {"backend": "vmm", "pool": pool_name})
            assert "\n" not in str(info.value)
            assert not decode.has_unfinished()


@pytest.mark.parametrize("role, kv, params, match", [
    ("decode", "not a dict", GREEDY, "do_remote_prefill"),
    ("decode", {k: v for k, v in good_kv().items() if k != "address"}, GREEDY, "lacks address"),
    ("decode", good_kv(), SamplingParams(n=2), "one sequence"),
    ("prefill", {"do_remote_decode": False}, GREEDY, "do_remote_decode"),
    ("prefill", REMOTE, SamplingParams(beam_width=2, temperature=0.0), "one sequence"),
    ("colocated", REMOTE, GREEDY, "kv_role prefill or decode"),
])
def test_bad_requests_on_either_role_are_one_line_errors(engines, role, kv, params, match):
    with pytest.raises(RequestError, match=match):
        engines(role).add_request(PROMPT, params, kv_transfer_params=kv)


def test_a_vmm_role_without_a_pool_is_refused_after_releasing_its_cache(monkeypatch):
    closed = []
    from kvlab.common.kv.seam import KVCache
    real_close = KVCache.close
    monkeypatch.setattr(KVCache, "close", lambda self: closed.append(self) or real_close(self))
    with pytest.raises(ConfigError, match="same kv_pool"):
        Engine.from_config(make_config(**(BASE | {"backend": "vmm", "kv_role": "prefill"})))
    assert len(closed) == 1 and closed[0].closed


@pytest.mark.parametrize("overrides, match", [
    ({"kv_role": "router"}, "kv_role"),
    ({"handoff_timeout_s": 0}, "handoff_timeout_s"),
    ({"backend": "vmm", "kv_role": "decode"}, "same kv_pool"),
    ({"kv_role": "decode", "handoff_name": "p0"}, "handoff_name names a prefill engine"),
    ({"kv_role": "prefill", "handoff_peers": ["p0"]}, "handoff_peers lists the prefill engines"),
    ({"kv_role": "decode", "handoff_peers": ["a b"]}, "a handoff name is 1-64"),
    ({"kv_role": "decode", "handoff_peers": "p0"}, "handoff_peers is a list"),
])
def test_role_options_are_one_line_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        engine(**({"role": "colocated"} | overrides)) if "role" in overrides else \
            Engine.from_config(make_config(**(BASE | overrides)))
    assert "\n" not in str(info.value)


def test_a_vmm_import_whose_mapping_fails_gives_the_pages_back(engines, monkeypatch):
    """The pages were transferred, then mapping them failed: the request fails alone, the decode engine backs
    exactly what the ledger says it holds, the prefill engine forgets the pages, the next handoff works."""
    with pool.create(f"handoff-{os.getpid()}-{uuid.uuid4().hex[:8]}", 8 << 20, page_size=4096) as holder:
        vmm = {"backend": "vmm", "page_size": 4096, "kv_pool": holder.name}
        prefill, decode = engines("prefill", **vmm), engines("decode", **vmm)
        host = decode.cache.allocator.driver.os.pages.memory

        def refuse(*args, **kwargs):
            raise DriverError("mmap refused")
        with monkeypatch.context() as patch:
            patch.setattr(host, "mmap_at", refuse)
            failed = run(decode, kv=run(prefill, kv=REMOTE).kv_transfer_params)
        assert failed.outputs[0].finish_reason == "error" and "mmap refused" in failed.error
        settle(prefill, lambda s: s["failed"] == 1)
        backed = {}
        for role, e in (("prefill", prefill), ("decode", decode)):
            account = e.cache.allocator.driver.pool
            backed[role], held = account.holdings()
            assert held == len(backed[role])
            assert not backed[role] or account.member.still_holds(backed[role])
        assert backed["prefill"] == [] and backed["decode"]       # the pages moved; the decode keeps them as spares
        expected = run(engines("colocated")).outputs[0].token_ids
        assert run(decode, kv=run(prefill, kv=REMOTE).kv_transfer_params).outputs[0].token_ids == expected


def test_a_vmm_import_gives_the_backing_it_replaces_back_off_the_engines_thread(engines, monkeypatch):
    """A received page replaces the idle pool page behind a local page: that one goes back to the pool from the
    steward's thread, not inside the import. A transfer the ceiling allows only once those are given back gives
    them back first."""
    with pool.create(f"handoff-{os.getpid()}-{uuid.uuid4().hex[:8]}", 8 << 20, page_size=4096) as holder:
        vmm = {"backend": "vmm", "page_size": 4096, "kv_pool": holder.name, "max_num_seqs": 2}
        prefill, decode = engines("prefill", **vmm), engines("decode", **vmm)
        memory, expected = decode.cache.allocator.driver.os, run(engines("colocated")).outputs[0].token_ids
        for _ in range(2):                            # both slots' pages now idle: the next imports replace them
            assert run(decode, kv=run(prefill, kv=REMOTE).kv_transfer_params).outputs[0].token_ids == expected
        steward_round, memory.member._steward.on_round = memory.member._steward.on_round, None   # hold it still
        time.sleep(0.15)                              # past a round already under way (0.1 s apart)
        before = memory.member.record()
        assert run(decode, kv=run(prefill, kv=REMOTE).kv_transfer_params).outputs[0].token_ids == expected
        replaced, after = len(memory.retiring), memory.member.record()
        assert replaced > 0 and after.given == before.given and after.held == before.held + replaced
        pool.set_limits(holder.name, memory.member.engine, ceiling=(after.held + replaced - 1) * 4096)
        assert run(decode, kv=run(prefill, kv=REMOTE).kv_transfer_params).outputs[0].token_ids == expected
        assert memory.member.record().given == after.given + replaced      # given back before the transfer
        pending = list(memory.retiring)
        def refuse(pages):
            raise PoolError("pool gone")
        with monkeypatch.context() as patch:                                 # a give that fails keeps them
            patch.setattr(memory.member, "give", refuse)
            with pytest.raises(PoolError, match="pool gone"):
                memory.retire()
        assert pending and memory.retiring == pending
        memory.member._steward.on_round = steward_round
        deadline = time.monotonic() + 5
        while memory.retiring:
            assert time.monotonic() < deadline, "the steward did not give the replaced pages back"
            time.sleep(0.01)
        own, held = decode.cache.allocator.driver.pool.holdings()
        assert held == len(own) and memory.member.still_holds(own)


# -- the ledger's transfer step -----------------------------------------------------------------------------------
@pytest.fixture
def two_members():
    name = f"transfer-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    giver = pool.create(name, 64 * 4096, page_size=4096, engine="giver")
    taker = pool.join(name, engine="taker", ceiling=8 * 4096)
    yield giver, taker
    taker.close()
    giver.close()


def test_a_transfer_moves_ownership_all_or_nothing(two_members):
    giver, taker = two_members
    pages = giver.take(6)
    taker.receive(giver.index, os.getpid(), pages[:4])
    giver.forget(pages[:4])
    assert taker.still_holds(pages[:4]) and not giver.still_holds(pages[:4]) and giver.still_holds(pages[4:])
    before = giver.status()
    with pytest.raises(PoolError, match="no longer holds"):
        taker.receive(giver.index, os.getpid(), pages[2:])          # two of them are the taker's already
    with pytest.raises(PoolError, match="has left"):
        taker.receive(giver.index, os.getpid() + 1, pages[4:])      # the giver's slot, another process
    assert giver.status().engines == before.engines
    records = {e.name: e for e in before.engines}
    assert records["taker"].held == 4 == records["taker"].taken and records["giver"].given == 4


def test_a_transfer_past_the_takers_ceiling_is_refused_and_changes_nothing(two_members):
    giver, taker = two_members
    pages = giver.take(9)
    before = giver.status()
    with pytest.raises(TransferRefused, match="ceiling"):
        taker.receive(giver.index, os.getpid(), pages)
    assert giver.status() == before and giver.still_holds(pages)


def test_transfer_checks_page_ids(two_members):
    giver, taker = two_members
    attachment = giver._attachment
    with attachment.locked() as ledger, pytest.raises(PoolError, match="distinct page ids"):
        transfer(ledger, giver.index, os.getpid(), taker.index, np.array([1, 1]))
