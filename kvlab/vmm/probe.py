"""The vmm backend's probe for the invariant tests (common/kv/registry.py `BackendProbe`): it reads only the
allocator's `snapshot()` and `stats()` and the driver's public API, and reads K/V back through a second path
(the memfd store pages under the mappings, with pread: no virtual mapping is touched)."""
from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence

PAGE = 4096   # 16 tokens per page of the tests' shape (2 layers, 2 KV heads, head_dim 32, float32)


class VMMProbe:
    # 8 page groups (128 tokens) of the tests' 2-layer shape: 2 * num_layers tensors of PAGE-byte pages
    test_options: dict[str, Any] = {"page_size": PAGE, "kv_cache_bytes": 8 * 2 * 2 * PAGE}

    def read(self, cache: KVCache, seq: Sequence, n: int) -> torch.Tensor:
        """[L, 2, n, H_kv, D]: the slot's store pages read from the memfd."""
        s, snap, driver = cache.shape, cache.allocator.snapshot(), cache.allocator.driver
        geo = snap["geometry"]
        groups = snap["slots"][snap["slot_of"][seq.seq_id]]["groups"]
        pages = -(-(n * s.bytes_per_token_per_layer) // geo["page_size"])
        per_tensor = []
        for t in range(geo["num_tensors"]):
            raw = b"".join(os.pread(driver.os.fd, geo["page_size"], driver.os.page_offset(t * geo["num_groups"] + g))
                           if g >= 0 else bytes(geo["page_size"])   # below a sliding window: unmapped, zeros
                           for g in groups[:pages])
            flat = torch.frombuffer(bytearray(raw), dtype=s.torch_dtype) if raw else torch.zeros(0)
            per_tensor.append(flat[:n * s.num_kv_heads * s.head_dim].view(n, s.num_kv_heads, s.head_dim))
        k, v = per_tensor[:s.num_layers], per_tensor[s.num_layers:]
        return torch.stack([torch.stack([k[layer], v[layer]]) for layer in range(s.num_layers)])

    def check_structure(self, cache: KVCache, live: dict[int, Sequence], swapped: set[int],
                        may_share: Callable[[int, int, int], bool]) -> None:
        snap = cache.allocator.snapshot()
        geo, slots = snap["geometry"], snap["slots"]
        owners = {s["seq_id"]: s for s in slots if s["seq_id"] is not None}
        assert set(owners) == set(live), f"slot owners {sorted(owners)} != live {sorted(live)}"
        assert set(snap["swapped"]) == swapped, f"swapped {sorted(snap['swapped'])} != {sorted(swapped)}"
        slot_refs = Counter(g for s in slots for g in s["groups"][s["dropped"]:])
        assert all(g == -1 for s in slots for g in s["groups"][:s["dropped"]]), "a window-dropped page is listed"
        assert all(snap["refs"][g] == slot_refs.get(g, 0) for g in range(geo["num_groups"])), "group refcounts drift"
        mappers, put_off = _mappers(snap)
        store_maps = snap["driver"]["store_maps"]
        total = sum(len(place["mapped"]) for place in snap["places"])
        assert snap["driver"]["mapped_pages"] == total == sum(store_maps), "driver mapping counts drift"
        for store_page, where in mappers.items():
            assert store_maps[store_page] == len(where) + put_off[store_page]
            if len(where) > 1:
                _check_shared(store_page, where, slots, may_share)
        for sid, seq in live.items():
            _check_backed(snap, owners[sid], seq, cache.shape.bytes_per_token_per_layer)
        stale = sum(len(s["groups"]) for s in slots if s["seq_id"] is None)
        assert snap["reclaimable_units"] >= stale

    def window_units(self, cache: KVCache) -> dict[int, tuple[int, list[int]]]:
        """Per live sequence: the leading pages the window unmapped, and the page groups backing its held tokens
        (a slot's groups past its held tokens are reclaimable, counted free)."""
        snap = cache.allocator.snapshot()
        tpp = snap["geometry"]["tokens_per_page"]
        return {s["seq_id"]: (s["dropped"], s["groups"][s["dropped"]:-(-s["held"] // tpp)])
                for s in snap["slots"] if s["seq_id"] is not None}

    def check_drained(self, cache: KVCache) -> None:
        snap = cache.allocator.snapshot()
        assert not snap["slot_of"] and not snap["swapped"] and not snap["pending"]
        stale = sum(len(s["groups"]) for s in snap["slots"])
        assert snap["reclaimable_units"] == stale, "mapped pages beyond the reclaimable stale ones"
        put_off = sum(count for _, _, count in snap["put_off"])   # unmaps background mapping runs next step
        assert snap["driver"]["mapped_pages"] == (stale + put_off) * snap["geometry"]["num_tensors"]
        _check_idle(snap)

    def check_closed(self, cache: KVCache) -> None:
        driver = cache.allocator.driver
        assert driver.closed and driver.regions == [] and driver.stats.mapped_pages == 0 \
            and driver.stats.reserved_bytes == 0


def _check_idle(snap: dict[str, Any]) -> None:
    """Cached pages no slot owns (prefix caching) are whole page groups, mapped nowhere, and neither free nor
    in a stale slot: with the free list and the stale pages they account for every group (no leak)."""
    geo, idle = snap["geometry"], snap["idle_cached"]
    groups = geo["num_groups"]
    assert len(set(idle)) == len(idle) and all(snap["refs"][g] == 0 for g in idle), "an idle cached page is mapped"
    assert not set(idle) & {g for s in snap["slots"] for g in s["groups"]}, "an idle cached page sits in a slot"
    store_maps = snap["driver"]["store_maps"]
    assert all(store_maps[t * groups + g] == 0 for g in idle for t in range(geo["num_tensors"])), \
        "an idle cached page is mapped in some tensor"
    stale = sum(len(s["groups"]) - s["dropped"] for s in snap["slots"])
    assert snap["free_groups"] + stale + len(idle) == groups, "pages leaked: free + stale + idle != total"


def _mappers(snap: dict[str, Any]) -> tuple[dict[int, list[tuple[int, int]]], Counter]:
    """Pool page -> the (slot, page) of every place mapping it, from the driver's own page tables, and pool page ->
    how many more places map it whose unmap a growth put off (background mapping: no slot lists them any more)."""
    geo = snap["geometry"]
    put_off = {(slot, j) for slot, first, count in snap["put_off"] for j in range(first, first + count)}
    mappers: dict[int, list[tuple[int, int]]] = defaultdict(list)
    put_off_maps: Counter = Counter()
    for place in snap["places"]:
        for va, store_page in place["mapped"].items():
            rel = va * geo["page_size"] - place["offset"]
            if not 0 <= rel < geo["tensor_bytes"]:
                continue
            where = (rel // geo["row_bytes"], rel % geo["row_bytes"] // geo["page_size"])
            if where in put_off:
                put_off_maps[store_page] += 1
            else:
                mappers[store_page].append(where)
    return mappers, put_off_maps


def _check_shared(store_page: int, where: list[tuple[int, int]], slots: list[dict[str, Any]],
                  may_share: Callable[[int, int, int], bool]) -> None:
    owners = [slots[i]["seq_id"] for i, _ in where]
    assert all(o is not None for o in owners), f"store page {store_page} shared by a free slot"
    assert len({j for _, j in where}) == 1, f"store page {store_page} at different pages {where}"
    page = where[0][1]
    assert all(may_share(owners[0], o, page) for o in owners[1:]), \
        f"store page {store_page} mapped by unrelated slots {where}"


def _check_backed(snap: dict[str, Any], slot: dict[str, Any], seq: Sequence, token_bytes: int) -> None:
    """Every page holding the sequence's computed tokens is mapped in every tensor."""
    geo = snap["geometry"]
    pages = -(-(seq.num_computed_tokens * token_bytes) // geo["page_size"])
    for j in range(slot["dropped"], pages):   # pages below a sliding window are unmapped on purpose
        for tensor, place in enumerate(snap["places"]):
            va = (place["offset"] + slot["index"] * geo["row_bytes"] + j * geo["page_size"]) // geo["page_size"]
            assert va in place["mapped"], f"seq {seq.seq_id}: page {j} of tensor {tensor} unmapped"


PROBE = VMMProbe()
