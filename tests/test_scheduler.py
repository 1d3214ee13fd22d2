"""The scheduler over the real backends in accounting-only mode, driven by the RooflineRunner (no model)."""
from __future__ import annotations

import random

import pytest
from helpers.invariants import FakeClockRunner

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.errors import RequestError
from kvlab.common.kv.seam import create_cache
from kvlab.common.kv.types import KVShape
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.sequence import Sequence, SequenceStatus
from kvlab.experiments.sim.roofline import RooflineCost, RooflineRunner, hardware, model_spec

SHAPE = KVShape(num_layers=1, num_kv_heads=4, head_dim=64, num_q_heads=4)   # 2 KiB/token; 4 tokens/4 KiB page
BACKENDS = ["paged", "vmm", "reserve"]


def engine(backend: str = "paged", tokens: int = 256, **overrides) -> Engine:
    values = dict(backend=backend, kv_cache_bytes=tokens * SHAPE.bytes_per_token, block_size=4,
                  page_size=4096, max_model_len=128, watermark=0.0, check_invariants=True,
                  reserve_mode="oracle")
    values.update(overrides)
    config = make_config(**values)
    cache = create_cache(config, SHAPE, accounting_only=True)
    return Engine(config, cache, RooflineRunner(RooflineCost(hardware("h100"), model_spec("tiny"))))


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, **kw)


def step(eng: Engine):
    """One engine step that also returns the SchedulerOutput (for inspecting the batch)."""
    sched = eng.scheduler
    out = sched.schedule()
    sampled = eng.runner.execute(out)
    sched.update(out, sampled, eng.runner.clock())
    sched.check_invariants()
    eng.cache.check_invariants()
    return out


def run(eng: Engine, max_steps: int = 10_000) -> dict:
    outputs = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return outputs
        for o in eng.step().finished:
            outputs[o.request_id] = o
    raise AssertionError("engine did not finish")


def test_token_budget_and_chunked_prefill():
    eng = engine(max_num_batched_tokens=16, max_num_seqs=4)
    eng.add_request(list(range(40)), params(2))
    eng.add_request(list(range(10)), params(2))
    chunks = []
    while eng.has_unfinished():
        out = step(eng)
        assert out.num_tokens <= 16
        chunks.append([(it.seq.request_id, it.start, it.num_tokens, it.needs_logits) for it in out.items])
        eng.scheduler.pop_finished()
    assert chunks[0] == [("0", 0, 16, False)]
    assert chunks[1] == [("0", 16, 16, False)]
    assert chunks[2] == [("0", 32, 8, True), ("1", 0, 8, False)]     # the rest of the budget starts request 1
    assert chunks[3] == [("0", 40, 1, True), ("1", 8, 2, True)]


def test_max_num_seqs_bounds_the_batch():
    eng = engine(max_num_seqs=3, max_num_batched_tokens=64)
    for _ in range(8):
        eng.add_request([1, 2, 3], params(5))
    while eng.has_unfinished():
        step(eng)
        assert len(eng.scheduler.running) <= 3
        eng.scheduler.pop_finished()


def test_fcfs_admission_keeps_the_watermark_free_for_growth():
    eng = engine(tokens=100, watermark=0.2)              # 25 blocks of 4; watermark 5 blocks
    eng.add_request(list(range(60)), params(3))         # 15 blocks: alone, so no watermark applies
    eng.add_request(list(range(24)), params(3))         # 6 blocks: 6 + 5 > 25 - 15 -> must wait
    eng.add_request(list(range(4)), params(3))          # FCFS: may not overtake request 1
    step(eng)
    assert [s.request_id for s in eng.scheduler.running] == ["0"]
    assert [s.request_id for s in eng.scheduler.waiting] == ["1", "2"]
    outputs = run(eng)
    assert all(o.error is None for o in outputs.values()) and len(outputs) == 3
    assert eng.cache_stats().used_units == 0


def test_lone_request_ignores_the_watermark():
    eng = engine(tokens=100, watermark=0.5)
    eng.add_request(list(range(90)), params(4))
    assert run(eng)["0"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("backend", ["paged", "vmm"])
def test_recompute_preempts_the_newest_and_requeues_it_first(backend):
    eng = engine(backend, tokens=48, max_num_seqs=8)     # 12 blocks / pages of 4 tokens
    for _ in range(3):
        eng.add_request(list(range(12)), params(20))    # 3 units each at admission, 8 units at the end
    first_preempted = None
    while eng.has_unfinished() and first_preempted is None:
        out = step(eng)
        if out.preempted:
            first_preempted = out.preempted[0]
            assert first_preempted.request_id == "2"    # the most recently admitted
            assert first_preempted.num_computed_tokens == 0
            assert eng.scheduler.waiting[0] is first_preempted
        eng.scheduler.pop_finished()
    outputs = run(eng)
    m = eng.metrics()
    assert m.recompute_preemptions >= 1 and m.recomputed_tokens >= 12
    assert all(len(o.outputs[0].token_ids) == 20 for o in outputs.values())
    assert eng.cache_stats().used_units == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_swap_preemption_returns_before_new_admissions(backend):
    eng = engine(backend, tokens=48, preemption_mode="swap", reserve_mode="oracle")
    for _ in range(3):
        eng.add_request(list(range(12)), params(20))
    eng.add_request([5, 6], params(2))
    saw_swap = False
    while eng.has_unfinished():
        out = step(eng)
        sched = eng.scheduler
        if sched.swapped:
            saw_swap = True
            admitted = [it.seq for it in out.items if it.start == 0]
            assert not any(s.request_id == "3" for s in admitted), "admitted new work while some are swapped"
        assert all(s.status is SequenceStatus.SWAPPED for s in out.swapped_out)
        sched.pop_finished()
    stats = eng.cache_stats()
    assert stats.used_units == 0
    if backend == "reserve":      # oracle regions are reserved whole at admission: no growth, no swap
        assert not saw_swap
    else:
        assert saw_swap and eng.scheduler.stats.swap_ins >= 1 and stats.swapped_out_bytes > 0


def test_reserve_never_preempts_but_admits_fewer():
    eng = engine("reserve", tokens=64, reserve_mode="max", max_model_len=32)   # two regions of 32
    for _ in range(4):
        eng.add_request(list(range(8)), params(10))
    while eng.has_unfinished():
        step(eng)
        assert len(eng.scheduler.running) <= 2
        eng.scheduler.pop_finished()
    assert eng.scheduler.stats.preemptions == 0


def test_request_that_can_never_fit_fails_alone():
    eng = engine("paged", tokens=64)
    eng.add_request(list(range(8)), params(8), request_id="ok1")
    eng.add_request(list(range(50)), params(30), request_id="huge")     # 80 tokens > 64 in the whole cache
    eng.add_request(list(range(8)), params(8), request_id="ok2")
    outputs = run(eng)
    assert outputs["huge"].outputs[0].finish_reason == "error"
    assert "kv_cache_bytes" in outputs["huge"].error
    assert outputs["ok1"].error is None and outputs["ok2"].error is None
    assert len(outputs["ok2"].outputs[0].token_ids) == 8
    assert eng.metrics().num_failed == 1


@pytest.mark.parametrize("prompt, max_tokens, words", [
    (list(range(120)), 20, "max_model_len"),
    ([], 4, "empty"),
])
def test_bad_requests_raise_at_add(prompt, max_tokens, words):
    eng = engine()
    with pytest.raises(RequestError, match=words):
        eng.add_request(prompt, params(max_tokens))
    assert not eng.has_unfinished()


def test_too_wide_request_raises():
    eng = engine(max_num_seqs=2, max_num_batched_tokens=16)
    with pytest.raises(RequestError, match="max_num_seqs"):
        eng.add_request([1, 2], SamplingParams(n=3, max_tokens=4))


def test_duplicate_request_id_raises():
    eng = engine()
    eng.add_request([1, 2], params(4), request_id="a")
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request([1, 2], params(4), request_id="a")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_mid_run_frees_everything(backend, mode):
    eng = engine(backend, tokens=64, preemption_mode=mode)
    ids = [eng.add_request(list(range(10 + i)), params(30)) for i in range(5)]
    for _ in range(12):
        step(eng)
    sched = eng.scheduler
    assert sched.running and (sched.waiting or sched.swapped or backend == "reserve")
    for request_id in ids:
        assert eng.abort(request_id)
    assert not eng.abort(ids[0])
    assert not eng.has_unfinished() and not sched.running and not sched.waiting and not sched.swapped
    stats = eng.cache_stats()
    assert stats.used_units == 0 and stats.live_tokens == 0
    eng.cache.check_invariants()


@pytest.mark.parametrize("backend", ["paged", "vmm"])
def test_parallel_sampling_forks_at_the_first_token(backend):
    shared = engine(backend, tokens=512)
    shared.add_request(list(range(40)), SamplingParams(n=4, max_tokens=6, ignore_eos=True))
    out = step(shared)
    assert len(out.items) == 1 and out.specs[out.items[0].seq.seq_id].num_samples == 4
    assert len(shared.scheduler.running) == 4                     # children forked after the prefill
    run(shared)
    separate = engine(backend, tokens=512)
    for _ in range(4):
        separate.add_request(list(range(40)), params(6))
    run(separate)
    assert shared.metrics().peak_used_units < separate.metrics().peak_used_units
    assert shared.cache_stats().used_units == separate.cache_stats().used_units == 0


def test_reserve_fork_copies_and_falls_back_to_recompute_when_full():
    eng = engine("reserve", tokens=60, reserve_mode="oracle")      # 3 regions of 20: a fork needs a region
    eng.add_request(list(range(10)), SamplingParams(n=4, max_tokens=10, ignore_eos=True))
    outputs = run(eng)
    assert [len(c.token_ids) for c in outputs["0"].outputs] == [10] * 4
    assert eng.scheduler.stats.fork_fallbacks == 1                   # the fourth child had no region
    assert eng.cache_stats().extra["fork_copy_tokens"] == 2 * 10


def test_beam_search_forks_and_frees_beams():
    eng = engine("paged", tokens=512)
    eng.add_request(list(range(9)), SamplingParams(beam_width=3, n=2, max_tokens=5, ignore_eos=True))
    widths = []
    while eng.has_unfinished():
        step(eng)
        widths.append(len(eng.scheduler.running))
        eng.scheduler.pop_finished()
    assert max(widths) == 3
    assert eng.cache_stats().used_units == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mixed_workload_ends_with_an_empty_cache(backend, mode):
    eng = engine(backend, tokens=96, preemption_mode=mode, max_num_batched_tokens=32, max_num_seqs=6)
    lengths = [(3 + (7 * i) % 29, 2 + (5 * i) % 23) for i in range(14)]
    for i, (p, o) in enumerate(lengths):
        eng.add_request(list(range(p)), params(o, n=2 if i % 5 == 0 else 1))
    outputs = run(eng)
    for i, (p, o) in enumerate(lengths):
        assert all(len(c.token_ids) == o for c in outputs[str(i)].outputs)
    assert eng.cache_stats().used_units == 0 and eng.cache_stats().live_tokens == 0


def test_metrics_are_collected_and_serialisable():
    import json
    eng = engine("paged", tokens=64)
    eng.reset_metrics()
    for i in range(6):
        eng.add_request(list(range(10)), params(12))
    run(eng)
    m = eng.metrics()
    json.dumps(m.to_dict())
    assert m.output_tokens == 72 and m.num_requests == 6 and m.num_steps > 12
    assert 0 < m.kv_utilization <= 1 and m.mean_batch > 1
    assert m.preemptions > 0 and m.ttft_p50 is not None and m.tpot_p99 >= m.tpot_p50 > 0
    assert len(m.timeline["time"]) == m.num_steps


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixed_traffic_with_aborts(backend, mode, seed):
    """Random prompts, n > 1, beams, aborts and late arrivals under a tight budget: invariants hold every
    step, every surviving request completes with the right lengths, and the cache ends empty."""
    import random
    rng = random.Random(seed)
    eng = engine(backend, tokens=160, preemption_mode=mode, max_num_seqs=8, max_num_batched_tokens=48,
                 watermark=0.02, reserve_mode=rng.choice(["max", "oracle"]), max_model_len=64)
    expected, aborted, outputs = {}, set(), {}

    def add(i: int) -> None:
        kind = rng.random()
        max_tokens = rng.randrange(1, 24)
        if kind < 0.15:
            p = SamplingParams(beam_width=rng.choice([2, 3]), max_tokens=max_tokens, ignore_eos=True)
        elif kind < 0.35:
            p = SamplingParams(n=rng.choice([2, 3]), max_tokens=max_tokens, ignore_eos=True)
        else:
            p = params(max_tokens)
        eng.add_request(list(range(rng.randrange(1, 40))), p, request_id=str(i))
        expected[str(i)] = (max_tokens, p.n)

    for i in range(12):
        add(i)
    for step_no in range(2000):
        if not eng.has_unfinished():
            break
        if step_no % 7 == 0 and step_no < 140:
            add(100 + step_no)
        if rng.random() < 0.03 and eng.scheduler.requests:
            victim = rng.choice(sorted(eng.scheduler.requests))
            assert eng.abort(victim)
            aborted.add(victim)
        step(eng)
        for o in eng.scheduler.pop_finished():
            outputs[o.request_id] = o
    assert not eng.has_unfinished()
    for request_id, (max_tokens, n) in expected.items():
        if request_id in aborted:
            assert request_id not in outputs
            continue
        req = outputs[request_id]
        assert req.error is None, req.error   # every request fits alone; beams take turns when they must
        finished = [s for s in req.seqs if s.finish_reason == "length"] if req.beam is None else req.beam.hyps
        assert len(finished) >= (n if req.beam is None else 1)
    stats = eng.cache_stats()
    assert stats.used_units == 0 and stats.live_tokens == 0


# -- beam search under memory pressure (the livelock of issue 8) -------------------------------------------------
class TokenHashRunner(FakeClockRunner):
    """Candidates that are a pure function of the sequence's tokens, as a model's would be: recomputing a sequence
    proposes the same candidates, so a tight cache must give exactly the results of a roomy one."""

    def candidates(self, seq: Sequence, k: int) -> list[tuple[int, float]]:
        rng = random.Random(",".join(map(str, seq.token_ids)))
        logprobs = sorted((-5 * rng.random() for _ in range(k)), reverse=True)
        return list(zip(rng.sample(range(3, 63), k), logprobs))


BEAM_PRESSURE = [([3], SamplingParams(max_tokens=1)),
                 ([4], SamplingParams(beam_width=2, max_tokens=25, ignore_eos=True)),
                 ([5 + i % 50 for i in range(39)], SamplingParams(beam_width=2, max_tokens=31, ignore_eos=True)),
                 (list(range(10, 30)), SamplingParams(n=2, max_tokens=20, ignore_eos=True)),
                 ([7] * 20, SamplingParams(beam_width=3, n=2, max_tokens=12, ignore_eos=True))]


def serve_beams(backend: str, tokens: int, mode: str = "recompute") -> tuple[dict, Engine]:
    config = make_config(backend=backend, kv_cache_bytes=tokens * SHAPE.bytes_per_token, block_size=4,
                          page_size=4096, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                          watermark=0.01, reserve_mode="oracle", preemption_mode=mode, check_invariants=True)
    eng = Engine(config, create_cache(config, SHAPE, accounting_only=True), TokenHashRunner())
    for prompt, p in BEAM_PRESSURE:
        eng.add_request(prompt, p)
    sched, results = eng.scheduler, {}
    for _ in range(3000):
        if not eng.has_unfinished():
            break
        out = sched.schedule()
        for it in out.items:                         # a beam whose candidates are in computes nothing more
            beam = sched.req_of[it.seq.seq_id].beam
            assert beam is None or it.seq.seq_id not in beam.stash, f"parked beam {it.seq.seq_id} was scheduled"
        sched.update(out, eng.runner.execute(out), eng.runner.clock())
        sched.check_invariants()
        eng.cache.check_invariants()
        for req in sched.pop_finished():
            results[req.request_id] = req
    stats = sched.stats
    assert not eng.has_unfinished(), f"unfinished after 3000 steps: {sorted(sched.requests)}, {stats}"
    assert eng.cache_stats().used_units == 0
    return {rid: (req.error, sorted((h.score, h.token_ids) for h in req.beam.hyps) if req.beam else
                  [s.token_ids for s in req.seqs]) for rid, req in results.items()}, eng


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_groups_that_cannot_share_finish_with_the_results_of_a_roomy_cache(backend, mode):
    """The livelock: an idle beam kept its KV while its sibling waited behind work that was preempted and
    readmitted first, forever. Idle beams are now released (candidates kept) and parked until their group
    steps, so every request finishes, with exactly the beams and samples a cache without pressure gives."""
    roomy, roomy_engine = serve_beams(backend, tokens=4096)
    tight, tight_engine = serve_beams(backend, tokens=96, mode=mode)
    assert roomy_engine.scheduler.stats.preemptions == 0
    assert all(error is None for error, _ in tight.values()), tight
    assert tight == roomy
    assert tight_engine.scheduler.stats.idle_beam_releases > 0      # the pressure did hit idle beams


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accounting_only", [True, False])
def test_holds_means_kv_resident_in_the_cache(backend, accounting_only):
    """The seam: holds(seq) is True from allocate/fork/swap_in until free/swap_out; swapped out is not held."""
    config = make_config(backend=backend, kv_cache_bytes=64 * SHAPE.bytes_per_token, block_size=4,
                          page_size=4096, max_model_len=32, reserve_mode="max")
    cache = create_cache(config, SHAPE, accounting_only=accounting_only).allocator
    try:
        seq = Sequence(0, "r", list(range(10)), max_tokens=4)
        assert not cache.holds(seq)
        cache.allocate(seq, 10)
        seq.num_computed_tokens = 10
        assert cache.holds(seq)
        cache.swap_out(seq)
        assert not cache.holds(seq)
        cache.swap_in(seq)
        assert cache.holds(seq)
        cache.swap_out(seq)
        cache.free(seq)                              # drops the host copy
        assert not cache.holds(seq) and cache.num_free_units() == cache.num_total_units()
        cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("kind", [{}, {"n": 2}, {"n": 2, "beam_width": 2}])
def test_a_finished_request_is_freed_without_the_cyclic_collector(kind):
    """A simulated search holds millions of objects: a request that cycled with its group waited for a full
    collection, which walked them all, where refcounting frees it as soon as the engine lets go."""
    import gc

    from kvlab.common.request import Request
    eng = engine(max_num_seqs=8)
    was_on = gc.isenabled()
    gc.disable()
    try:
        ids = [eng.add_request(list(range(8)), params(6, **kind)) for _ in range(3)]
        assert len([o for o in gc.get_objects() if type(o) is Request and o.request_id in ids]) == 3
        assert set(run(eng)) == set(ids)
        assert [o for o in gc.get_objects() if type(o) is Request and o.request_id in ids] == []
    finally:
        if was_on:
            gc.enable()
