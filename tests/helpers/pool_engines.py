"""Engines on a machine-wide pool, shared by the pool tests and the pool measurements (pool_ask_cost.py,
pool_wait_cost.py): the test prompts and engine options, an engine in another process, a starved engine beside a
busy one, and a counter of a member's asks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvlab import LLM, SamplingParams
from kvlab.vmm import pool

TESTS = Path(__file__).resolve().parents[1]
PROMPTS = [[1 + (7 * i + 3 * j) % 200 for j in range(5 + 9 * i)] for i in range(8)]
SHARED = [1 + (5 * j) % 190 for j in range(40)]           # five whole 8-token pages every prompt below starts with
PREFIX_PROMPTS = [SHARED + [1 + (7 * i + 3 * j) % 200 for j in range(3 + 5 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
BASE = {"model": "tiny", "backend": "vmm", "max_model_len": 256, "page_size": 4096, "kv_cache_bytes": 16 << 20,
        "max_num_seqs": 1}
PAGE = 4096
# an elastic engine on the same pools: 8-token blocks, one 4 KiB page of a tiny-model plane each (one-block chunks)
ELASTIC = {k: v for k, v in BASE.items() if k != "page_size"} | {"backend": "elastic", "elastic_block_size": 8,
                                                                   "elastic_page_size": PAGE}
LONGEST = 96 * PAGE          # the pages the longest request maps (68 prompt + 24 output tokens)
DEADLINE_S = 60.0


def pool_name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"



ENGINE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from kvlab import LLM, SamplingParams
from helpers.pool_engines import BASE, ELASTIC, PARAMS, PREFIX_PROMPTS, PROMPTS
caching = "prefix" in sys.argv[3:]
llm = LLM(**(ELASTIC if "elastic" in sys.argv[3:] else BASE), kv_pool=sys.argv[2], enable_prefix_caching=caching)
tokens = [r.outputs[0].token_ids for r in llm.generate(PREFIX_PROMPTS if caching else PROMPTS, PARAMS)]
stats = llm.cache_stats()
extra = stats.extra
print(json.dumps({"tokens": tokens, "pool": extra["pool"], "cached": extra.get("prefix_cached_pages", 0),
                  "mapped": stats.mapped_bytes}), flush=True)
sys.stdin.readline()                   # idle, holding its freed slots' (and cached) pages, until the test says stop
extra = llm.cache_stats().extra
print(json.dumps({**extra["pool"], "prefix_evictions": extra.get("prefix_evictions", 0)}), flush=True)
llm.close()
"""


def start_engine(name: str, *args: str) -> subprocess.Popen:
    """An engine in another process on pool `name` (args: "prefix" caches prefixes, "elastic" is an elastic
    engine, else vmm): it runs the test prompts, prints a line, idles until a line on its stdin, prints again."""
    return subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(TESTS), name, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=TESTS.parent)


def read_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"the engine process exited ({proc.wait(DEADLINE_S)})"
    return json.loads(line)


def wait_for(condition, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < DEADLINE_S, f"timed out waiting for {what}"
        time.sleep(0.01)
    return time.monotonic() - start


class Asks:
    """Counts a member's asks (each one is a wait for other engines)."""

    def __init__(self, member: pool.PoolMember) -> None:
        self.count, self.asking = 0, member.asking
        member.asking = self

    def __call__(self, n: int):
        self.count += 1
        return self.asking(n)


class BusyEngine:
    """Holds the whole pool, publishes it as givable and, asked, gives exactly what is wanted (as a busy engine
    gives its freed slots' pages), from its steward thread."""

    def __init__(self, member: pool.PoolMember) -> None:
        self.member, self.pages = member, member.take(member.total_pages)
        member.publish(len(self.pages))
        member.serve(self.answer)

    def answer(self, wanted: int) -> None:
        given, self.pages = self.pages[:wanted], self.pages[wanted:]
        self.member.give(given)
        self.member.publish(len(self.pages))


@dataclass(frozen=True)
class StarvedRun:
    tokens: list[int]
    asks: int
    seconds: float
    map_unmap_s: float
    preemptions: int


def starved_run() -> StarvedRun:
    """The longest test prompt on an engine whose pool a BusyEngine holds whole (pool_ask_cost.py prints it)."""
    with pool.create(pool_name(), LONGEST, page_size=PAGE, engine="busy") as member:
        BusyEngine(member)
        llm = LLM(**(BASE | {"kv_pool": member.name}))
        try:
            asks = Asks(llm.engine.cache.allocator.driver.member)
            t0 = time.perf_counter()
            out = llm.generate([PROMPTS[-1]], PARAMS)[0].outputs[0]
            seconds, stats = time.perf_counter() - t0, llm.cache_stats()
            return StarvedRun(out.token_ids, asks.count, seconds, stats.map_seconds + stats.unmap_seconds,
                              llm.metrics().preemptions)
        finally:
            llm.close()
