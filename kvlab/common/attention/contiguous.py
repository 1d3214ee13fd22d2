"""Contiguous attention kernels: no block tables, each sequence's K/V is row `slot` of [num_slots, max_len, H_kv, D].

A kernel may read only K[slot, :readable_lens[b]] of each item (`ContiguousMetadata.readable_lens`: the tokens of
the row that stay backed by memory for the whole step; the context when the metadata gives no bound). In the vmm
cache pages past that may be unmapped, and touching them is SIGSEGV (host) or a sticky illegal-address error
(CUDA). So no sequence is ever padded past its readable length (to max_len, or to the batch's longest context).

Decode (items with one query token) is batched in groups: one SDPA call reads K[slots, :L] for a group whose
contexts all fit under L and whose readable lengths all reach L, with each item's keys past its context masked
out. In the vmm cache a sequence's row is readable to its last page, so sequences ending in the same page (or
pages) share a call; with readable == context the groups are the equal-length groups, without a mask.
The groups, their masks and index tensors are planned once per step (`meta.plans`) and reused by every layer.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.common.attention.kv_quant import read_kv
from kvlab.common.attention.metadata import ContiguousMetadata, kernel_workspace
from kvlab.common.errors import RequestError

log = logging.getLogger("kvlab.kernels")

PLAN_KEY = "torch_sdpa_contiguous"     # the step's plan in meta.plans (shared by every layer)
RECOMPUTES_KEY = "torch_sdpa_contiguous.padding_recomputes"   # in the workspace: groups recomputed unpadded
# K/V bytes one more SDPA call is worth: on one CPU thread a decode call costs ~8 us of fixed overhead, the time
# to read ~256 KiB of K/V (benchmark shape). A sequence joins a group only if the padding it adds is cheaper.
CALL_COST_BYTES = 256 * 1024


@dataclass(slots=True)
class DecodeGroup:
    """One SDPA call: items (batch indices, by slot) reading keys [0, length) of their rows."""
    items: list[int]
    length: int
    masked: bool                  # some context is shorter than `length`: keys past it are masked


@dataclass(slots=True)
class GroupRun:
    """A decode group with this step's tensors, built once and reused by every layer."""
    rows: torch.Tensor            # int64 [n]: token row of each item in q / out
    first_slot: int | None        # slots are first_slot.. consecutively: a zero-copy view, else a gather
    slot_index: torch.Tensor | None
    length: int
    mask: torch.Tensor | None     # additive [n, 1, 1, length] in q's dtype: -inf past each item's context
    items: list[int]


@dataclass(slots=True)
class StepPlan:
    prefill: list[tuple[int, int, int, int]]   # (first row, end row, slot, context) of multi-token items
    decode: list[GroupRun]
    slots: list[int]
    contexts: list[int]
    padded: bool                                # some decode group reads past a context (masked)


def group_decode(contexts: list[int], readable: list[int], slots: list[int],
                 call_cost_tokens: int) -> list[DecodeGroup]:
    """Partition items into decode groups. Sorted by context, an item joins the open group while its context
    fits under every member's readable length (then keys [0, its context) are safe for all) and the padding it
    adds (the members' keys between the old and new group length) costs at most one call; else it opens a group.
    Without the cost cap this is the greedy interval stabbing, which minimises the number of calls."""
    groups: list[DecodeGroup] = []
    members: list[int] = []
    bound = length = 0
    for b in sorted(range(len(contexts)), key=contexts.__getitem__):
        ctx = contexts[b]
        if readable[b] < ctx:
            raise RequestError(f"a sequence's readable length {readable[b]} is shorter than its context {ctx}; "
                               "the cache's prepare must make every context readable")
        if members and ctx <= bound and len(members) * (ctx - length) <= call_cost_tokens:
            members.append(b)
            bound, length = min(bound, readable[b]), ctx
            continue
        if members:
            groups.append(_group(members, length, contexts, slots))
        members, bound, length = [b], readable[b], ctx
    if members:
        groups.append(_group(members, length, contexts, slots))
    return groups


def _group(members: list[int], length: int, contexts: list[int], slots: list[int]) -> DecodeGroup:
    items = sorted(members, key=slots.__getitem__)   # consecutive slots read as one view
    return DecodeGroup(items, length, any(contexts[b] < length for b in items))


def contiguous_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: ContiguousMetadata, scale: float) -> torch.Tensor:
    """torch SDPA over per-slot views, prefill (with past context, causal) and decode alike. -> [T, H, D]"""
    if meta.sliding_window is not None:
        return _windowed(q, k_cache, v_cache, meta, scale)
    plan = meta.plans.get(PLAN_KEY)
    if plan is None:
        plan = meta.plans[PLAN_KEY] = _plan(meta, k_cache, q)
    out = torch.empty_like(q)
    for lo, hi, slot, ctx in plan.prefill:
        out[lo:hi] = _one_sequence(q[lo:hi], *read_kv(k_cache[slot, :ctx], v_cache[slot, :ctx], meta, q.dtype),
                                   scale)
    for group in plan.decode:
        out.index_copy_(0, group.rows, _decode_group(q, k_cache, v_cache, group, scale, meta))
    # one cheap check per layer (on CUDA one sync; the per-layer .tolist() calls it replaces were three)
    if plan.padded and not math.isfinite(float(out.sum(dtype=torch.float32))):
        _recompute_poisoned_groups(out, q, k_cache, v_cache, plan, meta, scale)
    return out


def _plan(meta: ContiguousMetadata, k_cache: torch.Tensor, q: torch.Tensor) -> StepPlan:
    starts = meta.cu_query_lens.tolist()
    slots = meta.slots.tolist()
    contexts = meta.context_lens.tolist()
    readable = contexts if meta.readable_lens is None else meta.readable_lens.tolist()
    prefill, single = [], []
    for b in range(len(slots)):
        lo, hi = starts[b], starts[b + 1]
        if hi - lo == 1:
            single.append(b)
        elif hi > lo:
            prefill.append((lo, hi, slots[b], contexts[b]))
    token_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()   # one token's K and V
    groups = group_decode([contexts[b] for b in single], [readable[b] for b in single],
                          [slots[b] for b in single], CALL_COST_BYTES // max(token_bytes, 1))
    runs = [_group_run([single[i] for i in g.items], g, starts, slots, contexts, q) for g in groups]
    return StepPlan(prefill, runs, slots, contexts, any(g.masked for g in groups))


def _group_run(items: list[int], group: DecodeGroup, starts: list[int], slots: list[int], contexts: list[int],
               q: torch.Tensor) -> GroupRun:
    device = q.device
    group_slots = [slots[b] for b in items]
    first = group_slots[0]
    consecutive = group_slots == list(range(first, first + len(items)))
    mask = None
    if group.masked:   # additive: SDPA would convert a bool mask on every call
        ctx = torch.tensor([contexts[b] for b in items], device=device)
        past = torch.arange(group.length, device=device)[None, :] >= ctx[:, None]
        mask = torch.zeros(past.shape, dtype=q.dtype, device=device).masked_fill_(past, float("-inf"))
        mask = mask.view(len(items), 1, 1, group.length)
    return GroupRun(rows=torch.tensor([starts[b] for b in items], dtype=torch.int64, device=device),
                    first_slot=first if consecutive else None,
                    slot_index=None if consecutive else torch.tensor(group_slots, dtype=torch.int64, device=device),
                    length=group.length, mask=mask, items=items)


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: GroupRun,
                  scale: float, meta: ContiguousMetadata) -> torch.Tensor:
    """[n, H, D] for the group's items: one SDPA call over K/V [n, length, H_kv, D] (never a byte past any
    item's readable length: a view of consecutive rows, else a gather of exactly those rows)."""
    n, length = len(group.items), group.length
    if group.first_slot is not None:
        rows = slice(group.first_slot, group.first_slot + n)
        keys, values = k_cache[rows, :length], v_cache[rows, :length]
    else:
        keys = k_cache[:, :length].index_select(0, group.slot_index)
        values = v_cache[:, :length].index_select(0, group.slot_index)
    keys, values = read_kv(keys, values, meta, q.dtype)
    return F.scaled_dot_product_attention(q.index_select(0, group.rows).unsqueeze(2), keys.transpose(1, 2),
                                          values.transpose(1, 2), attn_mask=group.mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


def _recompute_poisoned_groups(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               plan: StepPlan, meta: ContiguousMetadata, scale: float) -> None:
    """A masked key still poisons the output when it is not finite (0 x inf = nan in P @ V), and memory past a
    context may hold anything (uninitialised CUDA pages). Recompute each padded group with a non-finite output
    one sequence at a time over exactly its context."""
    for group in plan.decode:
        if group.mask is None or bool(torch.isfinite(out.index_select(0, group.rows)).all()):
            continue
        workspace = kernel_workspace(meta)
        count = workspace[RECOMPUTES_KEY] = workspace.get(RECOMPUTES_KEY, 0) + 1
        (log.warning if count == 1 else log.debug)(
            "torch_sdpa_contiguous: a padded decode group of %d sequences gave a non-finite output (non-finite "
            "values past a context, or in the context itself); recomputed one sequence at a time (%d so far)",
            len(group.items), count)
        for row, b in zip(group.rows.tolist(), group.items):
            ctx = plan.contexts[b]
            keys, values = read_kv(k_cache[plan.slots[b], :ctx], v_cache[plan.slots[b], :ctx], meta, q.dtype)
            out[row:row + 1] = _one_sequence(q[row:row + 1], keys, values, scale)


def _windowed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ContiguousMetadata,
              scale: float) -> torch.Tensor:
    """Sliding window: each sequence alone, reading only keys [first query - W + 1, context) of its row (the
    vmm cache may have unmapped the pages below)."""
    items = meta.plans.get(PLAN_KEY + ".window")
    if items is None:
        starts, slots, contexts = meta.cu_query_lens.tolist(), meta.slots.tolist(), meta.context_lens.tolist()
        items = meta.plans[PLAN_KEY + ".window"] = [(starts[b], starts[b + 1], slots[b], contexts[b])
                                                    for b in range(len(slots)) if starts[b + 1] > starts[b]]
    window = meta.sliding_window
    out = torch.empty_like(q)
    for lo, hi, slot, ctx in items:
        first = max(ctx - (hi - lo) - window + 1, 0)
        keys, values = read_kv(k_cache[slot, first:ctx], v_cache[slot, first:ctx], meta, q.dtype)
        key_pos = torch.arange(first, ctx, device=q.device)
        query_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        diff = query_pos[:, None] - key_pos[None, :]
        mask = (diff >= 0) & (diff < window)
        attn = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                              values.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                              enable_gqa=True)
        out[lo:hi] = attn[0].transpose(0, 1)
    return out


def _one_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] at the last n positions of a context keys/values [ctx, H_kv, D]; causal, bottom-right."""
    n, ctx = q.shape[0], keys.shape[0]
    mask = None
    if n != ctx:
        past = ctx - n
        mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(past, ctx, device=q.device)[:, None]
    attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)
    return attn[0].transpose(0, 1)
