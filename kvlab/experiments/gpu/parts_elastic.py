"""The GPU check's part for the elastic backend (kvlab/elastic/): its CUDA path, the vmm CUDA driver
(vmm/drivers/cuda.py) under elastic's block pool, in two halves.

- block pool: an elastic allocator over CudaVirtualMemory on 2 MiB pages; sequences are admitted and grown, half
  are freed, then all: after every step the driver maps exactly the chunks that hold blocks, the mapped bytes exceed
  the held blocks' by less than one chunk per plane until the first free, and a drained pool maps nothing and (on
  the fake) holds no handle.
- tiny model: elastic's greedy tokens on the device equal paged's, and a drained elastic engine maps nothing.

With `dry`: the block pool over the recording fake driver (tests/fakes/fake_cuda.py; torch's CUDA views of it are
meta tensors, as its tests make them), the tiny model on cpu over the host driver: the plumbing, not the device."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from kvlab.experiments.gpu.driver import MiB, driver_module, mem_free

PAGE = 2 * MiB
PROMPTS = [[3 + (13 * i + 7 * j) % 900 for j in range(17 + 41 * i)] for i in range(6)]


def part_elastic_cuda(dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"block_pool": block_pool(dry), "tiny_model": tiny_model(dry)}
    problems = [k for k in ("block_pool", "tiny_model") if out[k].get("problems")]
    if problems:
        out["failed"] = "; ".join(f"{k}: {', '.join(out[k]['problems'])}" for k in problems)
    return out


def tiny_model(dry: bool) -> dict[str, Any]:
    """Greedy tokens of elastic and paged on the tiny model; the elastic engine's map calls and what it maps at the
    end (prefix caching off: nothing)."""
    from kvlab import LLM, SamplingParams
    device = "cpu" if dry else "cuda"
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    # fp16 on the GPU as vmm_vs_paged runs paged, so the Triton kernels it compiled are on disk already
    common = {"device": device, "dtype": "float32" if dry else "float16", "max_num_seqs": 6, "max_model_len": 512,
              "kv_cache_bytes": 32 * MiB, "threads": 1 if dry else 0}
    out: dict[str, Any] = {"device": device}
    tokens = {}
    for backend, opts in (("paged", {}), ("elastic", {"elastic_page_size": 64 * 1024 if dry else PAGE})):
        llm = LLM("tiny", backend=backend, **common, **opts)
        try:
            tokens[backend] = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
            stats = llm.cache_stats()
            out[backend] = {"kernels": llm.metrics().kernels, "kernel_fallbacks": llm.metrics().kernel_fallbacks,
                            "map_calls": stats.map_calls, "mapped_bytes_at_end": stats.mapped_bytes}
        finally:
            llm.close()
    out["identical_outputs"] = sum(a == b for a, b in zip(tokens["elastic"], tokens["paged"]))
    out["requests"] = len(PROMPTS)
    problems = []
    if out["identical_outputs"] != len(PROMPTS):
        problems.append(f"elastic's greedy tokens differ from paged's for {len(PROMPTS) - out['identical_outputs']}")
    if out["elastic"]["mapped_bytes_at_end"]:
        problems.append(f"a drained elastic engine still maps {out['elastic']['mapped_bytes_at_end']} bytes")
    if problems:
        out["problems"] = problems
    return out


@contextlib.contextmanager
def cuda_driver(dry: bool) -> Iterator[Any]:
    """The driver module, and on the dry run torch's CUDA tensor factories made to treat the fake's memory as
    they treat device memory (meta tensors), restored after."""
    drv = driver_module(dry)
    if not dry:
        yield drv
        return
    import sys

    import pytest  # the dry run's fake lives with the tests, and so does what patches torch for it
    with pytest.MonkeyPatch.context() as patch:
        sys.modules["fakes.fake_cuda"].torch_interop(patch, drv)
        yield drv


def block_pool(dry: bool) -> dict[str, Any]:
    from kvlab.common.config import make_config
    from kvlab.common.kv.types import KVShape
    from kvlab.elastic.allocator import ElasticAllocator
    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    shape = KVShape(num_layers=2, num_kv_heads=8, head_dim=128, num_q_heads=8, dtype="float16", device="cuda")
    config = make_config(backend="elastic", device="cuda", dtype="float16", elastic_block_size=16,
                         elastic_page_size=PAGE, kv_cache_bytes=64 * MiB, max_num_seqs=8, max_model_len=4096)
    with cuda_driver(dry) as drv:
        free_before = mem_free(dry)
        allocator = ElasticAllocator(config, shape, driver=CudaVirtualMemory(0, PAGE, driver=drv))
        try:
            out = walk(allocator, (lambda: len(drv.handles)) if dry else None)
            out["device_bytes_held_drained"] = None if free_before is None else free_before - mem_free(dry)
        finally:
            allocator.close()
        if dry:
            out["fake_leaks"] = {k: str(v) for k, v in drv.leaks().items()}
            if out["fake_leaks"]:
                out.setdefault("problems", []).append("the fake driver holds what was not given back")
    return out


def walk(allocator: Any, handles: Callable[[], int] | None) -> dict[str, Any]:
    """Eight sequences grow 120 tokens a step for six steps (360 of the pool's 504 blocks); the even ones are freed;
    the rest grow three more steps; all are freed. After every step the books, the driver and the blocks agree, and
    (`handles`: the fake's live physical handles) physical memory is exactly the mapped pages."""
    from kvlab.common.sequence import Sequence
    from kvlab.elastic.probe import chunks_in_use
    seqs = [Sequence(i, f"r{i}", [1] * 8, 4096) for i in range(8)]
    steps: list[dict[str, int]] = []
    problems: list[str] = []
    freed = False

    def check(label: str) -> None:
        snap = allocator.snapshot()
        mapped = set(snap["mapped_chunks"])
        held = sum(1 for c in snap["ref_counts"] if c) + len(snap["cached_free"])
        slack = len(mapped) - -(-held // snap["blocks_per_chunk"])
        pages = allocator.memory.mapped_pages()
        steps.append({"step": len(steps), "held_blocks": held, "mapped_chunks": len(mapped), "mapped_pages": pages})
        if mapped != chunks_in_use(snap):
            problems.append(f"{label}: chunks mapped without a block, or the reverse")
        books = allocator.geo.planes * sum(allocator.geo.pages_of(c) for c in mapped)
        if pages != books:
            problems.append(f"{label}: the driver maps {pages} pages, the mapped chunks hold {books}")
        if handles is not None and handles() != pages:
            problems.append(f"{label}: {handles()} physical handles live for {pages} mapped pages")
        if not freed and slack > 1:
            problems.append(f"{label}: {slack} chunks mapped beyond the blocks before any free")

    for step in range(1, 7):
        for seq in seqs:
            if allocator.allocate(seq, 120 * step) is None:
                problems.append(f"grow step {step}: the pool refused sequence {seq.seq_id}")
        check(f"grow step {step}")
    for seq in seqs[::2]:
        allocator.free(seq)
    freed = True
    check("half freed")
    for step in range(7, 10):
        for seq in seqs[1::2]:
            if allocator.allocate(seq, 120 * step) is None:
                problems.append(f"grow step {step}: the pool refused sequence {seq.seq_id}")
        check(f"grow step {step}")
    for seq in seqs[1::2]:
        allocator.free(seq)
    check("all freed")
    geo = allocator.geo
    out = {"page_size": geo.page_size, "blocks_per_chunk": geo.blocks_per_chunk, "num_chunks": geo.num_chunks,
           "planes": geo.planes, "steps": steps, "map_calls": allocator.memory.stats()["map_calls"],
           "peak_mapped_pages": max(s["mapped_pages"] for s in steps)}
    if steps[-1]["mapped_pages"]:
        problems.append(f"a drained pool still maps {steps[-1]['mapped_pages']} pages")
    if problems:
        out["problems"] = problems
    return out
