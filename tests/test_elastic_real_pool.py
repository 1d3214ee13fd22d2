"""Elastic engines on the real machine-wide pool (issue 38, docs/pool.md "Elastic engines on the pool"): the host
memfd pool, the pooled driver under the elastic backend, beside a vmm engine. Outputs never change (greedy tokens
equal an unpooled run's), an idle elastic engine with a warm prefix cache gives whole chunks back when another
engine asks (then, killed, the rest of its pages come back), and bad input is one line."""
from __future__ import annotations

import os
import signal

import pytest
from helpers.pool_engines import (
    BASE,
    ELASTIC,
    LONGEST,
    PAGE,
    PARAMS,
    PROMPTS,
    pool_name,
    read_line,
    start_engine,
    wait_for,
)

from kvlab import LLM
from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.experiments.cli.flags import engine_config
from kvlab.vmm import pool

LONG = PROMPTS[5:]      # the three longest prompts: the last maps LONGEST pages on either backend


def run(options: dict, prompts: list[list[int]] = LONG, **overrides) -> tuple[list[list[int]], dict]:
    """Greedy tokens and the cache stats' extra block of one engine's run."""
    llm = LLM(**(options | overrides))
    try:
        return [r.outputs[0].token_ids for r in llm.generate(prompts, PARAMS)], llm.cache_stats().extra
    finally:
        llm.close()


@pytest.fixture(scope="module")
def solo() -> dict[str, list[list[int]]]:
    return {"vmm": run(BASE)[0], "elastic": run(ELASTIC)[0]}


def record(holder: pool.PoolMember, pid: int) -> pool.EngineRecord:
    """The pool's status of the engine of process `pid`."""
    return next(e for e in holder.status().engines if e.pid == pid)


def test_an_elastic_and_a_vmm_engine_share_a_pool_and_generate_as_alone(solo):
    """The vmm engine runs first and idles on its freed slots' pages, most of the pool; the elastic engine is
    refused, asks, and the vmm engine's steward gives them back; both generate what they do unpooled. The elastic
    engine caches prefixes (these prompts share none), so it keeps chunks mapped, and holds exactly those."""
    with pool.create(pool_name(), LONGEST + 32 * PAGE, page_size=PAGE) as holder:
        vmm = LLM(**BASE, kv_pool=holder.name)
        elastic = LLM(**ELASTIC, kv_pool=holder.name, enable_prefix_caching=True)
        try:
            assert [r.outputs[0].token_ids for r in vmm.generate(LONG, PARAMS)] == solo["vmm"]
            assert holder.status().used > 32                 # pages: the elastic engine cannot run without them
            assert [r.outputs[0].token_ids for r in elastic.generate(LONG, PARAMS)] == solo["elastic"]
            stats = elastic.cache_stats()
            assert stats.extra["pool"]["pages_taken"] * PAGE >= LONGEST
            assert stats.extra["pool"]["engine_bytes"] == stats.mapped_bytes > 0
            assert vmm.cache_stats().extra["pool"]["pages_given"] > 0
        finally:
            vmm.close()
            elastic.close()
        assert holder.status().used == 0


def test_an_idle_elastic_engine_with_a_warm_prefix_cache_feeds_a_vmm_engine_and_kill_9_returns_the_rest(solo):
    """Elastic engine A (another process) caches prefixes and idles: its cached blocks keep their chunks mapped, and
    it holds exactly those. A hog takes the pool's free pages but 16; vmm engine B (this process) is refused and
    asks; A's steward forgets the cached blocks of whole chunks and gives their pages; the pool's status shows A
    holding less. Then kill -9 of A returns what it still held."""
    with pool.create(pool_name(), 512 * PAGE, page_size=PAGE) as holder:
        a = start_engine(holder.name, "elastic", "prefix")
        hog = None
        try:
            first = read_line(a)
            before = record(holder, a.pid).held
            assert before * PAGE == first["pool"]["engine_bytes"] == first["mapped"] and before * PAGE > LONGEST
            hog = pool.join(holder.name, engine="hog")
            assert hog.take(holder.status().free - 16) is not None
            tokens, extra = run(BASE, kv_pool=holder.name)
            assert tokens == solo["vmm"] and extra["pool"]["pages_taken"] * PAGE >= LONGEST
            after = record(holder, a.pid)
            assert after.held < before and (before - after.held) * PAGE >= LONGEST - 16 * PAGE
            assert after.given - first["pool"]["pages_given"] >= before - after.held      # given, whole chunks
            os.kill(a.pid, signal.SIGKILL)
            a.wait()
            hog.close()
            hog = None
            wait_for(lambda: holder.status().used == 0, "the killed engine's pages")
            assert [e.name for e in holder.status().engines] == [holder.engine]
        finally:
            if hog is not None:
                hog.close()
            a.kill()
            a.wait()


def test_the_elastic_page_size_must_be_the_pools():
    with pool.create(pool_name(), 1 << 20, page_size=2 * PAGE) as holder:
        with pytest.raises(ConfigError, match="elastic_page_size 4096; set elastic_page_size") as e:
            LLM(**ELASTIC, kv_pool=holder.name)
        assert "\n" not in str(e.value)
        assert holder.status().used == 0 and len(holder.status().engines) == 1


@pytest.mark.parametrize("backend", ["paged", "reserve"])
def test_kv_pool_on_a_backend_without_pages_on_demand_is_one_line(backend):
    with pytest.raises(ConfigError, match=f"mapped on demand \\(vmm or elastic\\), not '{backend}'") as e:
        make_config(backend=backend, kv_pool="p")
    assert "\n" not in str(e.value)


def test_the_pool_options_keep_their_spellings_for_either_backend(tmp_path):
    for backend in ("vmm", "elastic"):
        assert engine_config({"backend": backend, "kv_pool": "p", "kv_pool_bytes": 1 << 20}).kv_pool == "p"
        toml = tmp_path / f"{backend}.toml"
        toml.write_text(f'backend = "{backend}"\n[{backend}]\nkv_pool = "t"\nkv_pool_bytes = 1048576\n')
        config = make_config(toml)
        assert (config.kv_pool, config.kv_pool_bytes) == ("t", 1 << 20)
        assert make_config(toml, kv_pool="flag").kv_pool == "flag"        # a flag beats the file


def test_pool_status_names_each_engine_by_its_backend(capsys):
    """The books name an elastic engine `elastic-PID-TAG` and a vmm engine `vmm-PID-TAG`: `kvlab pool status`
    shows which backend holds what, and `kvlab pool limit` reaches the elastic engine by that name."""
    from helpers.invariants import SHAPE, backend_config

    from kvlab.common.kv.seam import create_cache
    from kvlab.experiments.cli.main import main
    with pool.create(pool_name(), 64 * PAGE, page_size=PAGE) as holder:
        caches = [create_cache(backend_config(b, kv_pool=holder.name), SHAPE) for b in ("elastic", "vmm")]
        try:
            names = sorted(e.name for e in holder.status().engines if e.name != holder.engine)
            assert [n.rsplit("-", 1)[0] for n in names] == [f"elastic-{os.getpid()}", f"vmm-{os.getpid()}"]
            assert caches[0].allocator.driver.member.engine == names[0]
            assert main(["pool", "status", holder.name]) == 0
            out = capsys.readouterr().out
            assert names[0] in out and names[1] in out
            assert main(["pool", "limit", holder.name, names[0], "--max", f"{8 * PAGE}"]) == 0
            assert holder.status().engine(names[0]).ceiling == 8
        finally:
            for cache in caches:
                cache.close()
        assert [e.name for e in holder.status().engines] == [holder.engine]
