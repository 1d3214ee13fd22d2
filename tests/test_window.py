"""Sliding-window attention (Mistral): HF parity and every backend's kernels agree.

- kvlab's model equals transformers' MistralForCausalLM (random tiny checkpoint, window 8, sequences spanning
  several windows) within 1e-4 in fp32: the cache-free reference and the cached forward through paged (torch and
  Triton kernels), vmm and reserve, with a chunked prefill and decode steps;
- greedy generation past several windows is token-for-token identical on paged, vmm and reserve and equals the
  reference model's greedy loop;
- the loader reads MistralConfig's `sliding_window`; kernels whose adapters pass no window are refused.
"""
from __future__ import annotations

import pytest
import torch
from helpers import checkpoints
from helpers.lazy import LazyImport

from kvlab.common.attention.declarations import REGISTRY
from kvlab.common.attention.dispatch import AttentionSpec
from kvlab.common.attention.metadata import BatchItem
from kvlab.common.config import make_config
from kvlab.common.kv.seam import create_cache
from kvlab.common.llm import LLM
from kvlab.common.loader import load_model
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.sequence import Sequence

transformers = LazyImport("transformers", reason="transformers (dev extra) is the ground truth")
pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
WINDOW = 8
VOCAB = 320


def mistral_checkpoint(path, window: int | None = WINDOW):
    return checkpoints.mistral_checkpoint(path, window, seed=99)


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    return path, mistral_checkpoint(path)


def test_loader_reads_the_window(checkpoint, tmp_path):
    model, _ = load_model(checkpoint[0])
    assert model.config.sliding_window == WINDOW and model.kv_shape().sliding_window == WINDOW
    mistral_checkpoint(tmp_path, window=None)
    assert load_model(tmp_path)[0].config.sliding_window is None


def test_reference_matches_hf(checkpoint):
    path, hf = checkpoint
    model, _ = load_model(path)
    tokens = ids(40, 1)
    expected = hf_logits(hf, tokens)
    got = model.reference_forward(torch.tensor([tokens]))[0]
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    # the window matters: full causal attention gives other logits
    model.config.sliding_window = None
    for layer in model.layers:
        layer.self_attn.sliding_window = None
    assert (model.reference_forward(torch.tensor([tokens]))[0] - expected).abs().max() > 1e-2


BACKENDS = {"paged": {}, "paged-triton": {"kernel": "triton_paged"}, "vmm": {}, "reserve": {}}


@pytest.mark.parametrize("name", BACKENDS)
def test_cached_forward_matches_hf(checkpoint, name):
    """Two sequences: a chunked prefill (7 tokens, then the rest; the other in one chunk), then 6 decode steps
    (past several windows); every logits row equals HF's at that position."""
    if name == "paged-triton":
        pytest.importorskip("triton")
    path, hf = checkpoint
    model, _ = load_model(path)
    backend = name.split("-")[0]
    config = make_config(backend=backend, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=128,
                         kv_cache_bytes=2 * 2**20, **BACKENDS[name])
    cache = create_cache(config, model.kv_shape())
    full = [ids(34, 2), ids(27, 3)]
    expected = [hf_logits(hf, f) for f in full]
    seqs = [Sequence(i, str(i), f[:-6], 8) for i, f in enumerate(full)]

    def step(items):
        for it in items:
            assert cache.allocator.allocate(it.seq, it.context_len) is not None
        meta = cache.storage.prepare(items)
        tokens = torch.tensor([t for it in items for t in it.seq.token_ids[it.start:it.context_len]])
        out = model(tokens, meta.input_positions, cache.storage, meta)
        for it in items:
            it.seq.num_computed_tokens = it.context_len
        return out

    try:
        got = step([BatchItem(seqs[0], 0, 7, needs_logits=False), BatchItem(seqs[1], 0, seqs[1].num_tokens)])
        torch.testing.assert_close(got, expected[1][seqs[1].num_tokens - 1:seqs[1].num_tokens], atol=TOL, rtol=0)
        got = step([BatchItem(seqs[0], 7, seqs[0].num_tokens - 7)])
        torch.testing.assert_close(got, expected[0][seqs[0].num_tokens - 1:seqs[0].num_tokens], atol=TOL, rtol=0)
        for _ in range(6):
            items = []
            for s, f in zip(seqs, full):
                s.append_token(f[s.num_tokens])
                items.append(BatchItem(s, s.num_tokens - 1, 1))
            got = step(items)
            rows = torch.stack([e[s.num_tokens - 1] for s, e in zip(seqs, expected)])
            torch.testing.assert_close(got, rows, atol=TOL, rtol=0)
    finally:
        cache.close()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model.reference_forward(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_identical_across_backends(checkpoint):
    path, _ = checkpoint
    prompts = [ids(12, 5), ids(21, 6), ids(3, 7)]
    outputs = {}
    for backend in ("paged", "vmm", "reserve"):
        llm = LLM(model=str(path), backend=backend, max_model_len=64, kv_cache_bytes=2 * 2**20, block_size=4)
        try:
            got = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
            outputs[backend] = [o.outputs[0].token_ids for o in got]
        finally:
            llm.engine.close()
    assert outputs["vmm"] == outputs["paged"] == outputs["reserve"]
    model, _ = load_model(path)
    assert outputs["paged"][0] == reference_greedy(model, prompts[0], 30)


def test_paged_frees_blocks_outside_the_window(checkpoint):
    """Greedy decoding 40 tokens past a 12-token prompt (window 8, blocks of 4): after every allocation the
    sequence's block table holds at most ceil(W / block) + 1 live blocks, the pool gets the rest back, and the
    tokens equal the cache-free reference's."""
    from kvlab.paged.allocator import DROPPED
    path, _ = checkpoint
    model, _ = load_model(path)
    config = make_config(backend="paged", block_size=4, max_model_len=64, kv_cache_bytes=2 * 2**20)
    cache = create_cache(config, model.kv_shape())
    prompt = ids(12, 8)
    seq = Sequence(0, "0", list(prompt), 40)
    bound = -(-WINDOW // 4) + 1
    try:
        item = BatchItem(seq, 0, len(prompt))
        for _ in range(40):
            assert cache.allocator.allocate(seq, item.context_len) is not None
            table = cache.allocator.snapshot()["tables"][0]
            if item.num_tokens == 1:
                assert len([b for b in table if b != DROPPED]) <= bound, table
            cache.allocator.check_invariants()
            meta = cache.storage.prepare([item])
            tokens = torch.tensor(seq.token_ids[item.start:item.context_len])
            logits = model(tokens, meta.input_positions, cache.storage, meta)
            seq.num_computed_tokens = item.context_len
            seq.append_token(int(logits[-1].argmax()))
            item = BatchItem(seq, seq.num_tokens - 1, 1)
        stats = cache.stats()
        assert stats.extra["window_dropped_blocks"] >= (len(prompt) + 39 - WINDOW) // 4 - 1
        assert stats.used_units <= bound
        assert seq.output_token_ids == reference_greedy(model, prompt, 40)
    finally:
        cache.close()


def test_adapters_without_a_window_are_refused():
    spec = AttentionSpec("paged", "cuda", "bfloat16", 128, 32, 8, block_size=256, compute_capability=(9, 0),
                         sliding_window=4096)
    reasons = {d.name: d.reasons_against(spec) for d in REGISTRY}
    for name in ("flash_attn_paged", "flashinfer_paged", "flex_paged", "flash_attn_contiguous"):
        assert any("sliding window" in r for r in reasons[name]), name
    for name in ("torch_paged", "triton_paged", "torch_sdpa_contiguous"):
        assert not any("sliding window" in r for r in reasons[name]), name
