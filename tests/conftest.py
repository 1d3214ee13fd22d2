import os
import signal

import torch

# One process cannot both interpret and compile Triton (the choice is read at each @triton.jit): without CUDA
# the suite runs the interpreter (docs/gpu-contracts.md §4); on a GPU machine it compiles, and the tests marked
# `triton_cpu` (they hand CPU tensors to the Triton kernel) are skipped: tests/test_gpu.py checks the compiled
# kernel against SDPA on cuda tensors instead. TRITON_INTERPRET=0 on a CPU machine shows the GPU selection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F
from backends.slab import SPEC as SLAB

from kvlab.common.attention.metadata import AttentionMetadata, BatchItem, base_metadata
from kvlab.common.kv.registry import register_backend
from kvlab.common.sequence import Sequence

# A shell runs background jobs (CI, `cmd &`) with SIGINT ignored, and children inherit that, so the tests that
# send SIGINT to a subprocess would see nothing: give this process a handler (exec resets it to the default).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

register_backend(SLAB)   # a fourth backend that lives only under tests/: the registry is the only seam it needs
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


class DenseTestCache:
    """Test-only stand-in for a backend's `attention`: each sequence's K/V lives in its own
    [max_len, H_kv, D] tensors per layer; writes go to positions [start, start + n), then causal SDPA.
    It follows the seam contract (write K/V, then attend over the full context) with no allocator."""

    def __init__(self, model, max_len: int) -> None:
        c = model.config
        self.num_layers, self.max_len = c.num_layers, max_len
        self.group = c.num_heads // c.num_kv_heads
        self.kv_dims = (max_len, c.num_kv_heads, c.head_dim)
        self.dtype, self.device = model.dtype, model.device
        self.store: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffers(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, seq_id)
        if key not in self.store:
            self.store[key] = (torch.zeros(self.kv_dims, dtype=self.dtype, device=self.device),
                               torch.zeros(self.kv_dims, dtype=self.dtype, device=self.device))
        return self.store[key]

    def attention(self, layer, q, k, v, meta, scale):
        out = torch.empty_like(q)
        cu = meta.cu_query_lens.tolist()
        for i, item in enumerate(meta.items):
            a, b, ctx = cu[i], cu[i + 1], item.context_len
            k_buf, v_buf = self._buffers(layer, item.seq.seq_id)
            k_buf[item.start:ctx] = k[a:b]
            v_buf[item.start:ctx] = v[a:b]
            keys = k_buf[:ctx].transpose(0, 1).repeat_interleave(self.group, dim=0)
            values = v_buf[:ctx].transpose(0, 1).repeat_interleave(self.group, dim=0)
            mask = torch.arange(ctx)[None, :] <= torch.arange(item.start, ctx)[:, None]
            attn = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, values, attn_mask=mask,
                                                  scale=scale)
            out[a:b] = attn.transpose(0, 1)
        return out


def cached_step(model, cache, items: list[BatchItem]) -> torch.Tensor:
    """Run one varlen step over `items` (token ids taken from each seq) -> logits [N, V]."""
    meta = AttentionMetadata(**base_metadata(items, device=str(model.device)))
    ids = [t for it in items for t in it.seq.token_ids[it.start:it.context_len]]
    input_ids = torch.tensor(ids, dtype=torch.int64, device=model.device)
    return model(input_ids, meta.input_positions, cache, meta)


def cached_greedy(model, prompts: list[list[int]], num_tokens: int, max_len: int = 512) -> list[list[int]]:
    """Greedy decode through `forward` + DenseTestCache: one prefill step for all prompts, then decode steps."""
    cache = DenseTestCache(model, max_len)
    seqs = [Sequence(i, str(i), p, num_tokens) for i, p in enumerate(prompts)]
    items = [BatchItem(s, 0, s.num_tokens) for s in seqs]
    for _ in range(num_tokens):
        logits = cached_step(model, cache, items)
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s.append_token(tok)
        items = [BatchItem(s, s.num_tokens - 1, 1) for s in seqs]
    return [s.output_token_ids for s in seqs]


@pytest.fixture
def dense_cache():
    """Factory: dense_cache(model, max_len) -> DenseTestCache."""
    return DenseTestCache


@pytest.fixture
def step():
    """step(model, cache, items) -> logits of the items that need them."""
    return cached_step


@pytest.fixture
def greedy_cached():
    """greedy_cached(model, prompts, num_tokens) -> generated ids per prompt, via forward + a dense cache."""
    return cached_greedy


@pytest.fixture
def one_thread():
    """One torch thread: steadier timings and no oversubscription on the shared 2-core machines."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_cpu: hands CPU tensors to the Triton kernel, so it needs the "
                                       "interpreter (skipped where Triton compiles, i.e. on a GPU machine)")


def pytest_collection_modifyitems(config, items):
    if INTERPRETING:
        return
    skip = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1, which conftest sets only "
                                   "without CUDA; tests/test_gpu.py runs the compiled kernel on cuda tensors")
    for item in items:
        if item.get_closest_marker("triton_cpu"):
            item.add_marker(skip)
