"""One engine of a prefill/decode pair in its own process, for tests/test_handoff_processes.py: built from the JSON
config in argv[1], driven by JSON lines on stdin (one answer line each), polling its handoffs while idle, exiting
when stdin closes. `fault` arms a kill -9 of this process at a point of the handoff."""
from __future__ import annotations

import json
import os
import select
import signal
import sys
from pathlib import Path

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.handoff import client, server
from kvlab.common.sampling_params import SamplingParams

POLL_S = 0.02


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def generate(engine: Engine, request: dict) -> dict:
    params = SamplingParams(max_tokens=request["max_tokens"], ignore_eos=True, temperature=0.0)
    engine.add_request(request["prompt"], params, kv_transfer_params=request.get("kv"))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().finished
    out = outputs[0]
    return {"tokens": out.outputs[0].token_ids, "finish": out.outputs[0].finish_reason, "error": out.error,
            "kv": out.kv_transfer_params, "handoff": out.handoff}


def handoff_files(pid: int) -> dict:
    """The handoff's memfds this process still has open or mapped."""
    fds = [_target(p) for p in Path(f"/proc/{pid}/fd").iterdir()]
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {"fds": sum("kvlab-handoff" in f for f in fds), "maps": sum("kvlab-handoff" in m for m in maps)}


def _target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:                      # the directory listing's own descriptor, closed since
        return ""


def pool_audit(engine: Engine) -> dict:
    """vmm on a pool: every pool page this engine maps, keeps, holds loose or is giving back is its own in the
    ledger."""
    if engine.config.kv_pool is None:
        return {}
    account = engine.cache.allocator.driver.pool
    backed, held = account.holdings()
    return {"backed": len(backed), "all_own": account.member.still_holds(backed) if backed else True, "held": held}


def state(engine: Engine) -> dict:
    engine.handoff.poll_idle()
    return {"handoff": engine.handoff.stats.to_dict(), "used_units": engine.cache_stats().used_units,
            "files": handoff_files(os.getpid()), "pool": pool_audit(engine), "pid": os.getpid()}


def arm(where: str) -> dict:
    if where == "before_ack":            # decode side: the pages are ours in the ledger and mapped, no ack sent
        client.acknowledge = die
    elif where == "after_send":          # prefill side: the offer went out, the ack is never read
        server.await_ack = die
    return {"armed": where}


def serve(engine: Engine, request: dict) -> dict:
    op = request.pop("op")
    if op == "generate":
        return generate(engine, request)
    if op == "state":
        return state(engine)
    if op == "fault":
        return arm(request["at"])
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    engine = Engine.from_config(make_config(**json.loads(sys.argv[1])))
    print(json.dumps({"pid": os.getpid(), "address": engine.handoff.address}), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        engine.handoff.poll_idle()
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        print(json.dumps(serve(engine, json.loads(line))), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
