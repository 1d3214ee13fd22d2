"""vmm with a sliding-window model (Mistral-style): pages wholly below the window are unmapped and go back to the pool.

- greedy tokens through a long generation past several windows, with 4 KiB pages, equal paged's and the cache-free
  reference's;
- after every step a sequence maps at most ceil(W / tokens_per_page) + 1 page groups, counted in the driver's own
  page tables (snapshot places, mapped pages, OS mappings), and the pool gets the rest back;
- fork and swap keep a window sequence correct (swap saves only the window's pages);
- in a subprocess, reading K at position 0 through the storage's view after the window passed it is a SIGSEGV;
- prefix caching with a window is refused on vmm, as on paged.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import checkpoints
from helpers.lazy import LazyImport

from kvlab.common.attention.metadata import BatchItem
from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.seam import create_cache
from kvlab.common.llm import LLM
from kvlab.common.loader import load_model
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.sequence import Sequence

transformers = LazyImport("transformers", reason="transformers (dev extra) builds the checkpoint")
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 24       # 1.5 pages of 16 tokens (4 KiB pages, 2 KV heads x 32 dims x fp32)
PAGE = 4096
VOCAB = 320


def mistral_checkpoint(path: Path) -> None:
    checkpoints.mistral_checkpoint(path, WINDOW, seed=7)


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model.reference_forward(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-w24")
    mistral_checkpoint(path)
    model, _ = load_model(path)
    return path, model


def vmm_cache(model, **options):
    config = make_config(backend="vmm", page_size=PAGE, max_model_len=192, max_num_seqs=4,
                         kv_cache_bytes=32 * 4 * PAGE, **options)
    return create_cache(config, model.kv_shape())


def bound(cache) -> int:
    return -(-WINDOW // cache.allocator.geo.tokens_per_page) + 1


def mapped_pages_of(cache, slot: int) -> int:
    """Pages mapped in slot `slot`'s row, all tensors together, read from the driver's own page tables."""
    snap = cache.allocator.snapshot()
    geo = snap["geometry"]
    count = 0
    for place in snap["places"]:
        for va in place["mapped"]:
            rel = va * geo["page_size"] - place["offset"]
            count += 0 <= rel < geo["tensor_bytes"] and rel // geo["row_bytes"] == slot
    return count


def forward(cache, model, seq: Sequence, item: BatchItem) -> torch.Tensor:
    """Allocate and run one forward; the item's tokens are computed after it."""
    assert cache.allocator.allocate(seq, item.context_len) is not None
    meta = cache.storage.prepare([item])
    with torch.no_grad():
        logits = model(torch.tensor(seq.token_ids[item.start:item.context_len]), meta.input_positions,
                       cache.storage, meta)
    seq.num_computed_tokens = item.context_len
    return logits


def step(cache, model, seq: Sequence, item: BatchItem) -> BatchItem:
    """One forward, then append the greedy token; the next decode item."""
    seq.append_token(int(forward(cache, model, seq, item)[-1].argmax()))
    return BatchItem(seq, seq.num_tokens - 1, 1)


def test_greedy_equals_paged_and_reference(checkpoint):
    """Generation past several windows (4 KiB pages): vmm's greedy tokens equal paged's and the reference's,
    and vmm really unmapped pages below the window."""
    path, model = checkpoint
    prompts = [ids(40, 1), ids(5, 2), ids(17, 3)]
    outputs, dropped = {}, 0
    for backend in ("paged", "vmm"):
        llm = LLM(model=str(path), backend=backend, max_model_len=192, kv_cache_bytes=2 * 2**20, block_size=16,
                  page_size=PAGE)
        try:
            got = llm.generate(prompts, SamplingParams(max_tokens=110, temperature=0, ignore_eos=True))
            outputs[backend] = [o.outputs[0].token_ids for o in got]
            if backend == "vmm":
                dropped = llm.engine.cache_stats().extra["window_dropped_pages"]
        finally:
            llm.engine.close()
    assert outputs["vmm"] == outputs["paged"]
    assert outputs["vmm"][0] == reference_greedy(model, prompts[0], 110)
    assert dropped >= 3 * (110 // 16 - 2), dropped


def test_pages_held_stay_within_the_window(checkpoint):
    """A 30-token prompt in two chunks, then 120 decode steps: after every allocate the slot maps at most
    ceil(W / page) + 1 page groups in every tensor (the driver's tables), the rest is free again, the OS mappings
    do not grow with the context, and the tokens equal the reference's."""
    _, model = checkpoint
    cache = vmm_cache(model)
    alloc = cache.allocator
    prompt = ids(30, 4)
    seq = Sequence(0, "0", list(prompt), 120)
    limit, tensors = bound(cache), alloc.geo.num_tensors
    mappings = []
    try:
        forward(cache, model, seq, BatchItem(seq, 0, 20))
        item = BatchItem(seq, 20, len(prompt) - 20)
        for _ in range(120):
            item = step(cache, model, seq, item)
            slot = alloc.snapshot()["slot_of"][0]
            held = mapped_pages_of(cache, slot)
            assert held <= limit * tensors, (held, limit, tensors)
            assert held == alloc.stats().extra["mapped_va_pages"]
            assert alloc.num_free_units() >= alloc.num_total_units() - limit
            mappings.append(alloc.stats().num_mappings)
            alloc.check_invariants()
        assert max(mappings[60:]) <= max(mappings[:20]), mappings
        assert alloc.stats().extra["window_dropped_pages"] >= (30 + 119 - WINDOW) // 16 - 1
        assert seq.output_token_ids == reference_greedy(model, prompt, 120)
        alloc.free(seq)
        alloc.check_invariants()
        assert alloc.num_free_units() == alloc.num_total_units()
    finally:
        cache.close()


def test_fork_and_swap_keep_the_window(checkpoint):
    """After the window unmapped pages: a fork child continues with the parent's tokens, a swapped-out sequence
    saves only the window's pages and resumes with the reference's tokens."""
    _, model = checkpoint
    cache = vmm_cache(model)
    alloc = cache.allocator
    prompt = ids(9, 5)
    expected = reference_greedy(model, prompt, 90)
    parent = Sequence(0, "0", list(prompt), 90)
    try:
        item = BatchItem(parent, 0, len(prompt))
        for _ in range(50):
            item = step(cache, model, parent, item)
        assert alloc.snapshot()["slots"][alloc.snapshot()["slot_of"][0]]["dropped"] > 0
        child = Sequence(1, "1", list(parent.token_ids), 40)
        child.num_computed_tokens = parent.num_computed_tokens
        alloc.fork(parent, child)
        alloc.check_invariants()
        child_item = BatchItem(child, child.num_tokens - 1, 1)
        for _ in range(20):
            item = step(cache, model, parent, item)
            child_item = step(cache, model, child, child_item)
            alloc.check_invariants()
        assert child.token_ids == parent.token_ids
        out_before = alloc.stats().swapped_out_bytes
        alloc.swap_out(parent)
        saved = alloc.stats().swapped_out_bytes - out_before
        assert saved <= (WINDOW + 2 * 16) * cache.shape.bytes_per_token, saved   # the window's pages only
        alloc.check_invariants()
        assert alloc.swap_in(parent)
        alloc.check_invariants()
        for _ in range(20):
            item = step(cache, model, parent, item)
            alloc.check_invariants()
        assert parent.output_token_ids == expected
        for s in (parent, child):
            alloc.free(s)
        alloc.check_invariants()
        assert alloc.num_free_units() == alloc.num_total_units()
    finally:
        cache.close()


def test_prefix_caching_with_a_window_is_refused(checkpoint):
    _, model = checkpoint
    with pytest.raises(ConfigError, match="sliding-window"):
        vmm_cache(model, enable_prefix_caching=True)


SEGV = textwrap.dedent("""
    import sys, torch
    from kvlab.common.attention.metadata import BatchItem
    from kvlab.common.config import make_config
    from kvlab.common.kv.seam import create_cache
    from kvlab.common.loader import load_model
    from kvlab.common.sequence import Sequence
    model, _ = load_model(sys.argv[1])
    config = make_config(backend="vmm", page_size=4096, max_model_len=192, max_num_seqs=2, kv_cache_bytes=1 << 20)
    cache = create_cache(config, model.kv_shape())
    seq = Sequence(0, "0", list(range(1, 11)), 80)
    item = BatchItem(seq, 0, 10)
    k = cache.storage.views.k[0]
    for i in range(80):
        assert cache.allocator.allocate(seq, item.context_len) is not None
        if i == 0:
            first = float(k[0, 0].abs().sum())   # page 0 is mapped before the window passes it
        meta = cache.storage.prepare([item])
        with torch.no_grad():
            logits = model(torch.tensor(seq.token_ids[item.start:item.context_len]), meta.input_positions,
                           cache.storage, meta)
        seq.num_computed_tokens = item.context_len
        seq.append_token(int(logits[-1].argmax()))
        item = BatchItem(seq, seq.num_tokens - 1, 1)
    assert cache.allocator.allocate(seq, item.context_len) is not None
    assert cache.allocator.snapshot()["slots"][0]["dropped"] >= 2
    print("generated ok", float(k[0, seq.num_tokens - 2].abs().sum()) > 0, flush=True)
    print(float(k[0, 0].sum()), flush=True)   # below the window: unmapped
    print("survived", flush=True)
""")


def test_pages_below_the_window_really_are_unmapped(checkpoint):
    path, _ = checkpoint
    proc = subprocess.run([sys.executable, "-c", SEGV, str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert "generated ok True" in proc.stdout, proc.stderr[-2000:]
    assert "survived" not in proc.stdout
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-1000:])
