"""`slab`: a fourth backend that exists only under tests/. Every sequence gets one fixed row of max_model_len
tokens (a slab) in a [num_slots, max_len, H_kv, D] tensor per layer, the contiguous kernels read it, fork copies
the row and swap copies it to host memory. Crude on purpose (it is the reserve baseline without the arena):
what it proves is that a backend plugs in through `register_backend` alone, without editing any file outside
tests/, and then passes the shared contract tests, the hypothesis invariants and the cross-backend equality."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.common.attention.metadata import AttentionMetadata, BatchItem, ContiguousMetadata, base_metadata
from kvlab.common.errors import OutOfKVCache
from kvlab.common.kv.options import check_positive, check_types
from kvlab.common.kv.registry import BackendSpec
from kvlab.common.kv.seam import Allocator, DataStorage, KVCache, NullStorage, timed
from kvlab.common.kv.types import CacheStats, CopyKV, DropSavedKV, RestoreKV, SaveKV
from kvlab.common.sequence import Sequence


@dataclass(slots=True)
class SlabOptions:
    slab_spare_slots: int = field(default=0, metadata={"help": "slab: slots kept out of use (a test knob)"})

    def validate(self) -> None:
        check_types(self)
        if self.slab_spare_slots < 0:
            check_positive(self, "slab_spare_slots")


class SlabAllocator(Allocator):
    name, unit_name = "slab", "slab"

    def __init__(self, config, shape) -> None:
        self.tokens_per_unit = self.max_len = config.max_model_len
        row_bytes = self.max_len * shape.bytes_per_token
        spare = config.options_of("slab").slab_spare_slots
        self.num_slots = max(0, config.kv_cache_bytes // row_bytes - spare)
        self.free_slots = list(range(self.num_slots - 1, -1, -1))    # pop() hands out slot 0 first
        self.slot_of: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.swapped: dict[int, int] = {}                # seq_id -> tokens saved (the storage holds the copy)

    def num_total_units(self) -> int:
        return self.num_slots

    def num_free_units(self) -> int:
        return len(self.free_slots)

    def units_needed(self, seq: Sequence, num_tokens: int) -> int:
        if seq.seq_id in self.slot_of:
            return 0 if num_tokens <= self.max_len else 1
        return 1

    def _take_slot(self, seq: Sequence, reserve_units: int) -> int | None:
        if len(self.free_slots) < 1 + reserve_units:
            return None
        slot = self.slot_of[seq.seq_id] = self.free_slots.pop()
        self.held[seq.seq_id] = 0
        return slot

    @timed
    def allocate(self, seq: Sequence, num_tokens: int, reserve_units: int = 0) -> int | None:
        if num_tokens > self.max_len:
            return None
        if seq.seq_id not in self.slot_of and self._take_slot(seq, reserve_units) is None:
            return None
        self.held[seq.seq_id] = max(self.held[seq.seq_id], num_tokens)
        return 0

    def _drop(self, seq_id: int) -> None:
        self.free_slots.append(self.slot_of.pop(seq_id))
        self.held.pop(seq_id)

    @timed
    def free(self, seq: Sequence) -> None:
        if seq.seq_id in self.slot_of:
            self._drop(seq.seq_id)
        elif self.swapped.pop(seq.seq_id, None) is not None:
            self.emit(DropSavedKV(seq.seq_id))

    @timed
    def fork(self, parent: Sequence, child: Sequence) -> None:
        slot = self._take_slot(child, 0)
        if slot is None:
            raise OutOfKVCache(f"slab cache: no free slot to fork sequence {parent.seq_id}")
        self.held[child.seq_id] = self.held[parent.seq_id]
        self.emit(CopyKV(self.slot_of[parent.seq_id], slot, self.held[parent.seq_id]))

    @timed
    def swap_out(self, seq: Sequence) -> None:
        self.swapped[seq.seq_id] = self.held[seq.seq_id]
        self.emit(SaveKV(seq.seq_id, self.slot_of[seq.seq_id], self.held[seq.seq_id]))
        self._drop(seq.seq_id)

    @timed
    def swap_in(self, seq: Sequence, reserve_units: int = 0) -> bool:
        slot = self._take_slot(seq, reserve_units)
        if slot is None:
            return False
        self.held[seq.seq_id] = self.swapped.pop(seq.seq_id)
        self.emit(RestoreKV(seq.seq_id, slot, self.held[seq.seq_id]))
        return True

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.slot_of

    def stats(self) -> CacheStats:
        used = len(self.slot_of)
        return CacheStats(backend=self.name, unit_name=self.unit_name, tokens_per_unit=self.max_len,
                          total_units=self.num_slots, used_units=used, free_units=len(self.free_slots),
                          live_tokens=sum(self.held.values()), allocated_token_slots=used * self.max_len,
                          allocator_seconds=self.allocator_seconds)

    def snapshot(self) -> dict[str, Any]:
        return {"slot_of": dict(self.slot_of), "held": dict(self.held), "swapped": set(self.swapped),
                "free_slots": sorted(self.free_slots), "num_slots": self.num_slots}

    def check_invariants(self) -> None:
        used = set(self.slot_of.values())
        assert len(used) == len(self.slot_of), "two sequences share a slot"
        assert used.isdisjoint(self.free_slots) and len(used) + len(self.free_slots) == self.num_slots
        assert all(n <= self.max_len for n in self.held.values())


class SlabStorage(DataStorage):
    """Addresses in the allocator's orders are slots."""

    def __init__(self, config, shape, books: SlabAllocator) -> None:
        super().__init__()
        self.books, self.shape = books, shape
        dims = (max(books.num_slots, 1), books.max_len, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(dims, dtype=shape.torch_dtype, device=shape.device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.build_dispatcher(shape, "contiguous", config.kernel)

    def copy(self, src: int, dst: int, n: int) -> None:
        for t in (*self.k, *self.v):
            t[dst, :n].copy_(t[src, :n])

    def save(self, slot: int, n: int) -> torch.Tensor:
        return torch.stack([torch.stack([k[slot, :n], v[slot, :n]]) for k, v in zip(self.k, self.v)]).cpu()

    def restore(self, slot: int, n: int, host: torch.Tensor) -> None:
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[slot, :n].copy_(host[layer, 0])
            v[slot, :n].copy_(host[layer, 1])

    def prepare(self, items: list[BatchItem]) -> AttentionMetadata:
        kw = base_metadata(items, self.shape.device)
        slots = torch.tensor([self.books.slot_of[it.seq.seq_id] for it in items], dtype=torch.int64)
        return ContiguousMetadata(**kw, slots=slots.to(self.shape.device),
                                  readable_lens=torch.full_like(slots, self.books.max_len).to(self.shape.device))

    def attention(self, layer, q, k, v, meta: ContiguousMetadata, scale: float) -> torch.Tensor:
        rows = meta.slots.repeat_interleave(meta.query_lens.long())
        self.k[layer][rows, meta.input_positions] = k
        self.v[layer][rows, meta.input_positions] = v
        return self.dispatcher.run(meta.phase, q, self.k[layer], self.v[layer], meta, scale)

    def close(self) -> None:
        super().close()
        self.k, self.v = [], []


def build_slab(config, shape, accounting_only: bool = False) -> KVCache:
    books = SlabAllocator(config, shape)
    storage = NullStorage() if accounting_only else SlabStorage(config, shape, books)
    return KVCache(allocator=books, storage=storage, shape=shape)


class SlabProbe:
    # the invariant tests' shape is 1 KiB per token and max_model_len 64: six slabs
    test_options: dict[str, Any] = {"kv_cache_bytes": 6 * 64 * 1024}

    def read(self, cache: KVCache, seq: Sequence, n: int) -> torch.Tensor:
        slot = cache.allocator.snapshot()["slot_of"][seq.seq_id]
        return torch.stack([torch.stack([k[slot, :n], v[slot, :n]])
                            for k, v in zip(cache.storage.k, cache.storage.v)])

    def check_structure(self, cache: KVCache, live: dict[int, Sequence], swapped: set[int],
                        may_share: Callable[[int, int, int], bool]) -> None:
        snap = cache.allocator.snapshot()
        assert set(snap["slot_of"]) == set(live) and snap["swapped"] == swapped
        for sid, seq in live.items():
            assert snap["held"][sid] >= seq.num_computed_tokens, f"seq {sid}: slab holds fewer tokens than computed"

    def check_drained(self, cache: KVCache) -> None:
        snap = cache.allocator.snapshot()
        assert not snap["slot_of"] and not snap["swapped"] and len(snap["free_slots"]) == snap["num_slots"]

    def check_closed(self, cache: KVCache) -> None:
        assert getattr(cache.storage, "k", []) == []


PROBE = SlabProbe()
SPEC = BackendSpec(name="slab", unit="slab", layout="contiguous", options=SlabOptions, build=build_slab,
                   label=lambda o: "slab", probe="backends.slab:PROBE", watermark=False,
                   help="tests only: one max_model_len row per sequence")
