"""One map budget per process (vmm/drivers/map_budget.py, issue 20 item 2): every host driver draws on it, a map
past it is refused like running out of KV (allocate returns None: the scheduler preempts or fails one request),
and the other caches of the process are unharmed. The process-wide tests run in subprocesses with the budget
lowered by KVLAB_MAP_BUDGET; the kernel's real limit is never approached."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvlab.common.errors import ConfigError, DriverError, OutOfKVCache
from kvlab.vmm.drivers.host import POOL_NAME, HostVirtualMemory
from kvlab.vmm.drivers.map_budget import ENV_CAP, MapBudget, MapBudgetExhausted, cap_from_env

ROOT = Path(__file__).resolve().parents[1]
KiB = 1024


def budget(cap: int, others: int = 0) -> MapBudget:
    """A budget with a fake kernel: a huge limit, `others` mappings that are not ours."""
    return MapBudget(cap, margin=0, limit=lambda: 1 << 30, count=lambda: others)


# -- the budget object ----------------------------------------------------------------------------------------
def test_drivers_sharing_a_budget_see_each_others_growth():
    shared = budget(cap=5)
    a, b = (HostVirtualMemory(4 * KiB, budget=shared) for _ in range(2))
    ra, rb = a.reserve(64 * a.page_size), b.reserve(64 * b.page_size)
    a.create_store(64)
    b.create_store(64)
    a.map(ra, 4 * a.page_size, 0)          # a range: 1 VMA; a page inside it: +2
    assert shared.held == 3 + 1            # a's range and page, b's bare range
    with pytest.raises(MapBudgetExhausted, match="map budget of 5"):
        b.map(rb, 4 * b.page_size, 0)      # b alone would fit; a's growth leaves no room
    assert not rb.mapped and b.stats.map_refusals == 1 and shared.refusals == 1
    b.map(rb, 0, 0)                        # at the edge of the range: +1, fits
    a.unmap(ra, 4 * a.page_size)           # always allowed; gives its mappings back
    b.map(rb, 4 * b.page_size, 4)
    a.close()
    b.close()
    assert shared.held == 0


def test_the_room_follows_the_rest_of_the_process():
    others = [100]
    shared = MapBudget(None, margin=10, limit=lambda: 120, count=lambda: others[0] + shared.held)
    vm = HostVirtualMemory(4 * KiB, budget=shared)
    region = vm.reserve(64 * vm.page_size)   # room: 120 - 100 - 10 = 10
    vm.create_store(64)
    for i in range(4):                        # +2 each: 9 held
        vm.map(region, (2 * i + 1) * vm.page_size, i)
    others[0] = 105                           # torch, threads: the room shrinks to 5
    with pytest.raises(MapBudgetExhausted):
        vm.map(region, 20 * vm.page_size, 20)
    vm.close()
    assert shared.held == 0


def test_refusal_is_out_of_kv_and_a_driver_error():
    assert issubclass(MapBudgetExhausted, OutOfKVCache) and issubclass(MapBudgetExhausted, DriverError)


@pytest.mark.parametrize("raw", ["0", "-3", "many", "1e3"])
def test_a_bad_cap_is_one_line(monkeypatch, raw):
    monkeypatch.setenv(ENV_CAP, raw)
    with pytest.raises(ConfigError, match=ENV_CAP):
        cap_from_env()


# -- whole caches in one process ----------------------------------------------------------------------------
SCRIPT = """
    import json, os, gc, torch
    torch.set_num_threads(1)
    from kvlab.common.errors import KvlabError
    from kvlab.common.llm import LLM
    from kvlab.common.sampling_params import SamplingParams
    from kvlab.vmm.drivers.map_budget import process_budget

    def build():
        return LLM(model="tiny", backend="vmm", kv_cache_bytes=96 * 4096, page_size=4096, max_model_len=96,
                   max_num_seqs=6, max_num_batched_tokens=64, background_mapping={background!r},
                   check_invariants=True)

    prompts = [[(7 * i + j) % 900 + 3 for j in range(5 + 7 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)

    def run(llm):
        return [[list(o.outputs[0].token_ids), o.error] for o in llm.generate(prompts, params)]

    report = dict(runs=[], refused_builds=[], preemptions=0, failed=0)
    llms = []
    for i in range({instances}):
        try:
            llms.append(build())
        except KvlabError as exc:
            report["refused_builds"].append(str(exc))
            continue
        report["runs"].append(run(llms[-1]))
    report["again"] = run(llms[0])                 # the first cache, after the others filled the budget
    for llm in llms:
        stats = llm.engine.scheduler.stats
        report["preemptions"] += stats.preemptions
        report["failed"] += stats.failed_requests
        llm.close()
    del llms, llm
    gc.collect()
    budget = process_budget()
    report["refusals"], report["held"] = budget.refusals, budget.held
    with open("/proc/self/maps") as f:
        report["pool_maps"] = sum({pool!r} in line for line in f)
    print("REPORT", json.dumps(report))
"""


def run_script(instances: int, cap: int | None, background: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_CAP}
    if cap is not None:
        env[ENV_CAP] = str(cap)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = textwrap.dedent(SCRIPT.format(instances=instances, background=background, pool=POOL_NAME))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.fixture(scope="module")
def reference() -> list:
    """Greedy outputs of one cache with the real budget (no refusal)."""
    report = run_script(1, None)
    assert report["refusals"] == 0 and report["failed"] == 0
    assert report["again"] == report["runs"][0]
    return report["runs"][0]


def check_outputs(runs: list, reference: list) -> int:
    """Each request either matches the reference or failed alone with a one-line error; returns the failures."""
    failed = 0
    for run in runs:
        for (tokens, error), (want, _) in zip(run, reference):
            if error is None:
                assert tokens == want
            else:
                assert "\n" not in error
                failed += 1
    return failed


@pytest.mark.parametrize("background", [False, pytest.param(True, marks=pytest.mark.slow)])   # ~7-13 s each
def test_one_cache_out_of_mappings_mid_run_preempts_instead_of_raising(reference, background):
    """A budget above what the cache needs to start but below what the batch needs: the run goes on."""
    report = run_script(1, cap=60, background=background)
    assert report["refusals"] > 0 and report["preemptions"] > 0
    check_outputs(report["runs"] + [report["again"]], reference)
    assert report["held"] == 0 and report["pool_maps"] == 0


@pytest.mark.slow      # ~9 s; test_drivers_sharing_a_budget_see_each_others_growth keeps the sharing in make test
def test_four_caches_share_one_budget_and_the_others_stay_unharmed(reference):
    """Four caches in one process, the budget enough for about two: a late cache is refused at build time or
    preempts; the first cache still gives the right outputs afterwards; closing gives every mapping back."""
    report = run_script(4, cap=200)
    assert report["refusals"] > 0
    assert report["refused_builds"] or report["preemptions"] > 0
    assert all("map budget" in msg and "\n" not in msg for msg in report["refused_builds"])
    assert report["runs"][0] == reference                      # the first cache ran before the budget filled
    check_outputs(report["runs"] + [report["again"]], reference)
    assert report["held"] == 0 and report["pool_maps"] == 0


def test_a_budget_too_small_for_any_request_fails_each_alone(reference):
    """Room for the ranges but not for one sequence's pages: every request fails alone, nothing raises."""
    report = run_script(1, cap=10)
    assert report["failed"] == 2 * len(reference) and report["refusals"] > 0
    assert check_outputs(report["runs"] + [report["again"]], reference) == 2 * len(reference)
    assert report["held"] == 0 and report["pool_maps"] == 0
