"""VMM crash safety: a kernel never reads an unmapped page (the invariant check runs before every kernel call when
config.check_invariants is on), random workloads in subprocesses never die by a signal, and the CUDA driver
path releases every reservation and handle when any driver call fails (failures injected at each call of a
workload with the recording fake)."""
from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fakes.fake_cuda import INVALID_VALUE, FakeCudaDriver
from fakes.fake_cuda_state import CallLog
from helpers.invariants import one_torch_thread  # noqa: F401 - module fixture

from kvlab.common.config import make_config
from kvlab.common.errors import DriverError, OutOfKVCache
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.vmm.build import build_vmm
from kvlab.vmm.drivers.cuda import CudaVirtualMemory

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "TRITON_INTERPRET": "1",
       "OMP_NUM_THREADS": "1"}


def run_python(script: str, timeout: int = 180) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: int = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def describe(rc: int) -> str:
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


# -- the invariant check stands between a corrupted page table and the kernel ------------------------------------
CORRUPT = """
    import sys, torch
    from helpers.invariants import SHAPE, backend_config
    from kvlab.common.attention.metadata import BatchItem
    from kvlab.common.kv.seam import create_cache
    from kvlab.common.sequence import Sequence

    backend, corruption, check = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
    torch.manual_seed(0)
    kv = create_cache(backend_config(backend, check_invariants=check), SHAPE)
    cache, storage = kv.allocator, kv.storage
    kernel_calls = []

    class Spy:   # counts kernel launches, delegates everything else
        def __init__(self, inner):
            self.inner = inner
        def run(self, *args):
            kernel_calls.append(args[0])
            return self.inner.run(*args)
        def __getattr__(self, name):
            return getattr(self.inner, name)
    storage.dispatcher = Spy(storage.dispatcher)
    seq = Sequence(1, "1", list(range(3, 40)), max_tokens=8)
    cache.allocate(seq, 37)

    def step(start, n):
        meta = storage.prepare([BatchItem(seq, start, n)])
        for layer in range(SHAPE.num_layers):
            storage.attention(layer, torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32), meta, 0.2)
        seq.num_computed_tokens = start + n

    step(0, 37)
    calls_before = len(kernel_calls)
    if corruption == "unmapped-page":          # a page unmapped behind the cache's back (driver != books)
        region, offset = cache.ranges.places[0]
        slot = cache.snapshot()["slot_of"][1]
        cache.driver.unmap(region, offset + slot * cache.geo.row_bytes, 1)
    elif corruption == "held-past-pages":      # the books claim tokens no page backs
        cache.table.of(1).held = cache.geo.max_len
    elif corruption == "block-out-of-pool":    # a block table entry outside the pool
        cache.seqs[1].table[0] = cache.pool.num_blocks + 1000
    seq.append_token(5)
    cache.allocate(seq, 38)
    try:
        step(37, 1)
        print("kernel ran on the corrupted state")
    except AssertionError as e:
        print("CAUGHT", e)
    print("KERNEL_CALLS_AFTER_CORRUPTION", len(kernel_calls) - calls_before)
"""

CORRUPTIONS = [
    ("vmm", "unmapped-page", "is not mapped to group"),
    ("vmm", "held-past-pages", "live tokens but only"),
    ("paged", "block-out-of-pool", "reference count 1 but 0 block tables use it"),
]


@pytest.mark.parametrize("backend,corruption,message", CORRUPTIONS, ids=[c[1] for c in CORRUPTIONS])
def test_a_corrupted_cache_is_caught_before_the_kernel_runs(backend, corruption, message):
    """In a subprocess, so that a miss would show as a signal rather than take pytest down."""
    rc, out, err = finish(run_python(CORRUPT.replace("sys.argv[1], sys.argv[2], sys.argv[3]",
                                                     f"{backend!r}, {corruption!r}, 'on'")))
    assert rc == 0, f"{describe(rc)}\n{err[-2000:]}"
    assert "CAUGHT" in out and message in out, out + err[-2000:]
    assert "KERNEL_CALLS_AFTER_CORRUPTION 0" in out, out


def test_without_the_check_the_same_corruption_kills_the_process():
    """The counterfactual that makes the check worth having: the contiguous kernel reads the unmapped page."""
    rc, out, err = finish(run_python(CORRUPT.replace("sys.argv[1], sys.argv[2], sys.argv[3]",
                                                     "'vmm', 'unmapped-page', 'off'")))
    assert rc == -signal.SIGSEGV, f"expected SIGSEGV, got {describe(rc)}: {out} {err[-1000:]}"


# -- random workloads in subprocesses ---------------------------------------------------------------------------
CACHE_WORKLOAD = """
    import json
    from helpers.invariants import random_workload
    for name, backend, seed, overrides in {runs!r}:
        ops = random_workload(backend, False, seed, {num_ops}, **overrides)
        print("OPS", name, json.dumps(ops))
"""

ENGINE_WORKLOAD = """
    import json, random, torch
    torch.set_num_threads(1)
    from kvlab.common.llm import LLM
    from kvlab.common.sampling_params import SamplingParams
    rng = random.Random({seed})
    llm = LLM(model="tiny", backend={backend!r}, kv_cache_bytes=96 * 4096, page_size=4096, block_size=8,
              max_model_len=128, max_num_seqs=6, max_num_batched_tokens=64, reserve_mode="oracle",
              preemption_mode={mode!r}, check_invariants=True, background_mapping={backend!r} == "vmm")
    engine = llm.engine
    added = aborted = finished = failed = 0
    for wave in range(6):
        for _ in range(rng.randint(2, 6)):
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))]
            params = SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randint(1, 40), ignore_eos=True,
                                    temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(100))
            engine.add_request(prompt, params)
            added += 1
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.2 and engine.scheduler.requests:
                aborted += engine.abort(rng.choice(sorted(engine.scheduler.requests)))
            for out in engine.step().finished:
                finished += 1
                failed += out.error is not None
    while engine.has_unfinished():
        for out in engine.step().finished:
            finished += 1
            failed += out.error is not None
    stats = engine.cache.stats()
    assert stats.used_units == 0 and stats.live_tokens == 0, stats
    llm.close()
    print("OPS", {name!r}, json.dumps(dict(added=added, aborted=aborted, finished=finished, failed=failed)))
"""

CACHE_RUNS = [
    [("vmm real, check_invariants", "vmm", 11, {"check_invariants": True}),
     ("vmm real, background mapping", "vmm", 12, {"background_mapping": True})],
    [("paged real, prefix caching", "paged", 13, {"enable_prefix_caching": True}),
     ("reserve real", "reserve", 14, {})],
]
ENGINE_WORKLOADS = [
    ENGINE_WORKLOAD.format(backend="vmm", seed=21, mode="swap", name="engine vmm swap"),
    ENGINE_WORKLOAD.format(backend="paged", seed=22, mode="recompute", name="engine paged recompute"),
]


def cache_workloads(num_ops: int) -> list[str]:
    return [CACHE_WORKLOAD.format(runs=runs, num_ops=num_ops) for runs in CACHE_RUNS]


def test_random_workloads_never_die_by_a_signal(capsys):
    run_workloads(cache_workloads(400), capsys, runs=4)


@pytest.mark.slow      # ~12 s more: two engines with random aborts, and 2.5x the cache operations
def test_long_random_workloads_and_engines_never_die_by_a_signal(capsys):
    run_workloads(cache_workloads(1000) + ENGINE_WORKLOADS, capsys, runs=6)


def run_workloads(scripts: list[str], capsys, runs: int) -> None:
    """Two processes at a time (the machine has two cores); each must exit 0 after its own leak checks and print
    one OPS line a run (`runs` in all)."""
    results = []
    for i in range(0, len(scripts), 2):
        procs = [run_python(script) for script in scripts[i:i + 2]]
        results += [finish(proc) for proc in procs]
    lines = []
    for rc, out, err in results:
        assert rc >= 0, f"{describe(rc)}\n{out}\n{err[-3000:]}"
        assert rc == 0, f"{describe(rc)}\n{out}\n{err[-3000:]}"
        lines += [line[4:] for line in out.splitlines() if line.startswith("OPS ")]
    assert len(lines) == runs, lines
    with capsys.disabled():
        print("\n[crash-safety] " + "\n[crash-safety] ".join(lines))


# -- the CUDA driver path under injected failures ------------------------------------------------------------------
GRAN = 2 * 1024**2
CUDA_SHAPE = KVShape(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=8, dtype="float16", device="cuda")
CUDA_CONFIG = make_config(backend="vmm", device="cuda", page_size=GRAN, kv_cache_bytes=5 * 2 * GRAN,
                           max_num_seqs=3, max_model_len=4096, max_num_batched_tokens=4096)
RELEASE_CALLS = {"cuMemAddressFree": "reservations", "cuMemRelease": "handles",
                 "cuDevicePrimaryCtxRelease": "primary_retains"}
UNMAP_CALLS = ("cuCtxSynchronize", "cuMemUnmap")


def books_match_the_device(driver: CudaVirtualMemory, fake: FakeCudaDriver) -> str:
    """'ok' if the driver books exactly the mappings the device has, else what differs."""
    booked = {r.base + va * driver.page_size for r in driver.regions for va in r.mapped}
    device = set(fake.mappings)
    if booked == device:
        return "ok"
    return f"booked but not mapped: {len(booked - device)}, mapped but not booked: {len(device - booked)}"


def cuda_workload(fake: FakeCudaDriver) -> dict:
    """Grow, fork + copy-on-write, swap out, free (drops shared pages), reclaim, swap in, free all, close (1,024
    tokens per page). Returns what failed, whether the books still balanced and matched the device right after
    and once every sequence was freed, and what leaked."""
    result = {"error": None, "books": "ok", "device": "ok", "phase": "start-up"}
    try:
        cache = build_vmm(CUDA_CONFIG, CUDA_SHAPE, accounting_only=True,
                          driver=CudaVirtualMemory(0, driver=fake)).allocator
    except DriverError as exc:
        result["error"] = str(exc)
        result["leaks"] = fake.leaks()
        return result
    held: list[Sequence] = []

    def seq(i: int, n: int) -> Sequence:
        s = Sequence(i, str(i), [1] * n, 8)
        s.num_computed_tokens = n
        return s
    a, b, c, d = seq(0, 1500), seq(1, 100), seq(2, 1500), seq(3, 2000)
    steps = [("allocate a", lambda: (cache.allocate(a, 1500), held.append(a))),
             ("allocate b", lambda: (cache.allocate(b, 100), held.append(b))),
             ("fork a->c", lambda: (cache.fork(a, c), held.append(c), fake.launch())),
             ("copy-on-write c", lambda: (c.token_ids.extend([2] * 600), cache.allocate(c, 2100))),
             ("swap out b", lambda: (cache.swap_out(b), held.remove(b))),
             ("free a", lambda: (cache.free(a), held.remove(a))),
             ("reclaim for d", lambda: (cache.allocate(d, 2000), held.append(d))),
             ("free d", lambda: (cache.free(d), held.remove(d))),
             ("swap in b", lambda: (cache.swap_in(b), held.append(b)))]
    try:
        for name, op in steps:
            result["phase"] = name
            op()
        result["phase"] = "close"
    except (DriverError, OutOfKVCache) as exc:
        result["error"] = str(exc)
        result["device"] = books_match_the_device(cache.driver, fake)
        try:
            cache.check_invariants()
        except AssertionError as broken:
            result["books"] = str(broken)
    for s in held + ([] if b in held else [b]):   # clean up as a caller would; b may still be swapped out
        try:
            cache.free(s)
        except DriverError as exc:
            result["error"] = result["error"] or str(exc)
    try:
        cache.check_invariants()
        result["freed"] = "ok"
    except AssertionError as broken:
        result["freed"] = str(broken)
    try:
        cache.close()
    except DriverError as exc:
        result["error"] = result["error"] or str(exc)
    result["leaks"] = fake.leaks()
    return result


@functools.cache
def injection_points() -> list[tuple[int, str, int]]:
    """(index, call name, occurrence) of every driver call a clean run of the workload makes."""
    fake = FakeCudaDriver(granularity=GRAN)
    clean = cuda_workload(fake)
    assert clean["error"] is None and clean["leaks"] == {}, clean
    names = fake.names()
    return [(i, name, names[:i].count(name)) for i, name in enumerate(names)]


def inject(name: str, occurrence: int, kind: str) -> dict:
    fake = FakeCudaDriver(granularity=GRAN)
    fake.fail(name, INVALID_VALUE, after=occurrence, exc=RuntimeError("injected") if kind == "exception" else None)
    logging.disable(logging.CRITICAL)   # every injected failure logs; the assertions below say what matters
    try:
        return cuda_workload(fake)
    finally:
        logging.disable(logging.NOTSET)


def run_injections(keep) -> tuple[int, list[str]]:
    checked, problems = 0, []
    for i, name, occurrence in injection_points():
        if not keep(name):
            continue
        for kind in ("result", "exception"):
            r = inject(name, occurrence, kind)
            checked += 1
            assert r["error"] and name in r["error"], f"call {i} ({name}): the failure did not surface: {r}"
            allowed = {RELEASE_CALLS[name]: 1} if name in RELEASE_CALLS else {}
            leaked = {k: len(v) for k, v in r["leaks"].items()}
            if any(n > allowed.get(k, 0) for k, n in leaked.items()) or r["books"] != "ok" or r["device"] != "ok" \
                    or r.get("freed", "ok") != "ok":
                problems.append(f"call {i} {name}#{occurrence} ({kind}) in {r['phase']}: leaked {leaked}, "
                                f"books: {r['books']}, device: {r['device']}, after freeing: {r.get('freed')}")
    return checked, problems


def test_start_up_map_and_create_failures_release_everything(capsys):
    """Every failure outside the unmap path: nothing stays acquired and the books still balance."""
    checked, problems = run_injections(lambda name: name not in UNMAP_CALLS and name not in RELEASE_CALLS)
    with capsys.disabled():
        print(f"\n[crash-safety] cuda driver: {checked} injected failures outside unmap/release, "
              f"{len(problems)} problems")
    assert checked >= 40 and not problems, "\n".join(problems)


def test_a_failed_release_leaks_only_what_it_was_releasing():
    """cuMemAddressFree / cuMemRelease / cuDevicePrimaryCtxRelease failing in close(): that one object stays
    (the driver refused to take it back); every other reservation, handle and mapping is released."""
    checked, problems = run_injections(lambda name: name in RELEASE_CALLS)
    assert checked >= 10 and not problems, "\n".join(problems)


def test_a_failed_unmap_leaves_consistent_books_and_releases_everything(capsys):
    """Once reported: partial unmaps across the 2L tensors and within a run, a pool group lost in copy-on-write,
    and close() leaking the range after a failed unmap."""
    checked, problems = run_injections(lambda name: name in UNMAP_CALLS)
    with capsys.disabled():
        print(f"\n[crash-safety] cuda driver: {checked} injected unmap-path failures, {len(problems)} problems:\n  "
              + "\n  ".join(problems[:8]))
    assert not problems, "\n".join(problems)


class FailsTwice(CallLog):
    """A fake driver's call log that also fails the first map/unmap-path call after an injected failure: the one
    that would undo it."""
    second_failure = False

    def enter(self, name: str):
        if self.second_failure and name in UNDO_CALLS:
            self.second_failure = False
            self.calls.append((name, 0))
            return (INVALID_VALUE,)
        result = super().enter(name)
        self.second_failure = self.second_failure or result is not None
        return result


UNDO_CALLS = ("cuCtxSynchronize", "cuMemUnmap", "cuMemMap", "cuMemSetAccess")


def test_when_the_undo_fails_too_the_books_still_match_the_device_and_close_releases_everything(capsys):
    """Two failures in a row (an unmap or map, then the call that would undo it): the places may be left apart
    (TornMirror), but the driver books exactly what the device maps, freeing the sequences clears the torn pages
    so the books balance again, and close() still gives back every reservation, handle and mapping (in close()
    itself the second failure hits the retry of the same page: only that page and its range stay, and the error
    says so)."""
    checked, problems, torn = 0, [], 0
    for i, name, occurrence in injection_points():
        if name not in UNDO_CALLS:
            continue
        fake = FakeCudaDriver(granularity=GRAN, log=FailsTwice())
        fake.fail(name, INVALID_VALUE, after=occurrence)
        logging.disable(logging.CRITICAL)
        try:
            r = cuda_workload(fake)
        finally:
            logging.disable(logging.NOTSET)
        checked += 1
        assert r["error"] and name in r["error"], f"call {i} ({name}): the failure did not surface: {r}"
        torn += "torn" in r["error"] or "failed too" in r["error"]
        leaked = {k: len(v) for k, v in r["leaks"].items()}
        if r["phase"] == "close":   # no undo there: if the retry of the same page failed, it and its range stay
            ok = (leaked == {"reservations": 1, "mappings": 1} and "still held: 1 range(s) with 1 mapped" in r["error"]
                  or not leaked and "every range was released in the end" in r["error"])
        else:
            ok = not leaked
        if not ok or r["device"] != "ok" or r.get("freed", "ok") != "ok":
            problems.append(f"call {i} {name}#{occurrence} in {r['phase']}: leaked {leaked}, device: {r['device']}, "
                            f"after freeing: {r.get('freed')}, error: {r['error']}")
    with capsys.disabled():
        print(f"\n[crash-safety] cuda driver: {checked} double failures, {torn} left torn places, "
              f"{len(problems)} problems")
    assert checked >= 40 and torn > 0 and not problems, "\n".join(problems)
