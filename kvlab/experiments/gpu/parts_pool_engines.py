"""The GPU check's part for engines on a pool on the device (vmm/drivers/pooled_cuda.py): the tiny model in this
process and in a child process, both on one CUDA pool, started together (whichever claims the name makes the
chunks, the other imports them), generate the same prompts greedily; each must produce exactly the tokens of one
cuda vmm engine alone, and once both closed nothing of the pool is left. The child is bounded in time. With `dry`
the same runs on cpu over a host pool: the plumbing, not the device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20
CHILD_SECONDS = 90
PROMPTS = [[3 + (11 * i + 5 * j) % 900 for j in range(20 + 37 * i)] for i in range(4)]
CHILD = ("import sys; from kvlab.experiments.gpu.parts_pool_engines import child_main; "
         "sys.exit(child_main(sys.argv[1:]))")


def settings(dry: bool) -> dict[str, Any]:
    if dry:
        return {"device": "cpu", "page_size": 64 * 1024, "pool_bytes": 32 * MiB}
    return {"device": "cuda", "page_size": 2 * MiB, "pool_bytes": 512 * MiB}


def tokens(dry: bool, pool: str | None) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens of the prompts on one vmm engine (on `pool` if given) and its cache's pool block."""
    from kvlab import LLM, SamplingParams
    s = settings(dry)
    llm = LLM("tiny", backend="vmm", device=s["device"], page_size=s["page_size"], max_num_seqs=4,
              max_model_len=256, kv_pool=pool, kv_pool_bytes=s["pool_bytes"] if pool else None,
              threads=1 if dry else 0)
    try:
        result = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0))
        return [r.outputs[0].token_ids for r in result], llm.cache_stats().extra.get("pool", {})
    finally:
        llm.close()


def part_cuda_pool_engines(dry: bool) -> dict[str, Any]:
    from kvlab.vmm import pool
    t0 = time.perf_counter()
    name = f"gpu-check-{os.getpid()}"
    solo, _ = tokens(dry, None)
    child = subprocess.Popen([sys.executable, "-c", CHILD, "--dry" if dry else "--gpu", name],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        mine, block = tokens(dry, name)
        out_text, err_text = child.communicate(timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        out_text, err_text = child.communicate()
    out: dict[str, Any] = {"settings": settings(dry), "pool_block": block, "child_exit": child.returncode,
                           "this_engine_equals_solo": mine == solo}
    out["child"] = json.loads(out_text.strip().splitlines()[-1]) if child.returncode == 0 else {
        "stderr_tail": err_text[-1500:]}
    out["child_equals_solo"] = out["child"].get("tokens") == solo
    try:
        pool.status(name)
        out["pool_gone"] = False
    except pool.UnknownPool:
        out["pool_gone"] = True
    out["seconds"] = round(time.perf_counter() - t0, 2)
    problems = [k for k in ("this_engine_equals_solo", "child_equals_solo", "pool_gone") if not out[k]]
    if problems:
        out["failed"] = "failed: " + ", ".join(problems)
    out["child"].pop("tokens", None)
    return out


def child_main(argv: list[str]) -> int:
    got, block = tokens(argv[0] == "--dry", argv[1])
    print(json.dumps({"tokens": got, "pool_block": block}), flush=True)
    return 0
