"""Per-step attention metadata: what the scheduler hands a backend (BatchItem) and what every kernel reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvlab.common.sequence import Sequence

@dataclass(slots=True)
class BatchItem:
    """One sequence's share of a step: compute positions [start, start + num_tokens)."""
    seq: Sequence
    start: int
    num_tokens: int
    needs_logits: bool = True          # False for a prefill chunk that does not reach the last prompt token

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class AttentionMetadata:
    """Fields every backend fills; subclasses add their own (block tables, slot mapping, slot ids)."""
    items: list[BatchItem]
    input_positions: torch.Tensor      # int64 [T]
    query_lens: torch.Tensor           # int32 [B]
    context_lens: torch.Tensor         # int32 [B], tokens in cache after this step's writes
    cu_query_lens: torch.Tensor        # int32 [B + 1]
    max_query_len: int
    max_context_len: int
    logits_indices: torch.Tensor       # int64 [num items needing logits]: row of each item's last token
    workspace: dict | None = None      # kernel scratch that outlives the step (the dispatcher's own dict)
    plans: dict = field(default_factory=dict)   # per-step kernel plans shared by every layer (masks, wrappers)
    # fp8 KV cache (common/attention/kv_quant.py): the format of the uint8 cache bytes and this layer's scales,
    # restamped by the storage before every layer's kernel call; None: the cache holds the compute dtype
    kv_fp8: torch.dtype | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    # Mistral-style sliding window, set by the model: a query at position i sees keys (i - W, i]; None: all
    sliding_window: int | None = None

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def phase(self) -> str:
        return "decode" if self.is_decode else "prefill"

    @property
    def num_tokens(self) -> int:
        return int(self.input_positions.shape[0])


@dataclass(slots=True)
class PagedMetadata(AttentionMetadata):
    """Paged layout: caches are [num_blocks, block_size, H_kv, D] per layer."""
    block_tables: torch.Tensor = None      # int32 [B, max_blocks], unused entries 0
    slot_mapping: torch.Tensor = None      # int64 [T]: block_id * block_size + offset of each new token
    block_size: int = 16


@dataclass(slots=True)
class ContiguousMetadata(AttentionMetadata):
    """Contiguous layout (vmm, reserve): caches are [num_slots, max_len, H_kv, D] per layer."""
    slots: torch.Tensor = None             # int64 [B]: the cache row (slot) of each item
    # int64 [B]: tokens of each item's row backed by memory until the step ends (>= its context; the vmm
    # cache's pages up to the last one its held tokens need, the reserve region); kernels may read K[slot, :n]
    # for n up to this and never further. None: only the context is readable.
    readable_lens: torch.Tensor | None = None


def kernel_workspace(meta: AttentionMetadata) -> dict:
    """The scratch dict kernels keep buffers in: the dispatcher's (persistent per cache) or, for a direct
    kernel call, one that lives as long as `meta`."""
    if meta.workspace is None:
        meta.workspace = {}
    return meta.workspace


def base_metadata(items: list[BatchItem], device: str = "cpu") -> dict[str, Any]:
    """The common metadata fields as constructor kwargs; backends extend them."""
    import torch  # here, not at the top: the scheduler's BatchItem is read where torch is not (the simulator)
    query = [it.num_tokens for it in items]
    context = [it.context_len for it in items]
    cu = [0]
    for n in query:
        cu.append(cu[-1] + n)
    logits_rows = [cu[i + 1] - 1 for i, it in enumerate(items) if it.needs_logits]
    starts = torch.tensor([it.start for it in items], dtype=torch.int64)
    max_query = max(query, default=0)
    if max_query == 1 and cu[-1] == len(items):     # decode: one token per item, at its start
        positions = starts
    else:                        # token t of item b sits at start[b] + (t - cu[b]); no per-token Python loop
        offsets = starts - torch.tensor(cu[:-1], dtype=torch.int64)
        positions = torch.arange(cu[-1], dtype=torch.int64) + torch.repeat_interleave(
            offsets, torch.tensor(query, dtype=torch.int64), output_size=cu[-1])
    return dict(
        items=items,
        input_positions=positions.to(device),
        query_lens=torch.tensor(query, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context, dtype=torch.int32, device=device),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        max_query_len=max_query,
        max_context_len=max(context, default=0),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
    )
