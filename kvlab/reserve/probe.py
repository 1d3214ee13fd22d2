"""The reserve baseline's probe for the invariant tests: a second read path into the arena, and the region
structure checked from the allocator's public snapshot."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence


class ReserveProbe:
    # 160 tokens of the invariant tests' shape (2 layers, K and V, 2 heads x 32 dims x fp32: 1 KiB per token)
    test_options: dict[str, Any] = {"reserve_mode": "oracle", "kv_cache_bytes": 160 * 1024}

    def read(self, cache: KVCache, seq: Sequence, n: int) -> torch.Tensor:
        """The arena rows [start, start + n) read directly (the kernel reads them through the row view)."""
        start = cache.allocator.snapshot()["regions"][seq.seq_id][0]
        k, v = cache.storage.k, cache.storage.v
        return torch.stack([torch.stack([k[layer][start:start + n], v[layer][start:start + n]])
                            for layer in range(cache.shape.num_layers)])

    def check_structure(self, cache: KVCache, live: dict[int, Sequence], swapped: set[int],
                        may_share: Callable[[int, int, int], bool]) -> None:
        snap = cache.allocator.snapshot()
        regions = snap["regions"]
        assert set(regions) == set(live), f"regions {sorted(regions)} != live {sorted(live)}"
        assert snap["swapped"] == swapped
        end = 0
        for start, size in sorted(regions.values()):
            assert start >= end and size > 0, f"regions overlap at {start}"
            end = start + size
        assert end <= snap["capacity"]
        assert snap["free_units"] + sum(size for _, size in regions.values()) == snap["capacity"]
        for sid, seq in live.items():
            assert regions[sid][1] >= seq.num_computed_tokens, f"seq {sid}: region shorter than its tokens"

    def check_drained(self, cache: KVCache) -> None:
        snap = cache.allocator.snapshot()
        assert not snap["regions"] and not snap["swapped"] and snap["free_units"] == snap["capacity"]

    def check_closed(self, cache: KVCache) -> None:
        assert getattr(cache.storage, "k", []) == [], "the arena is still referenced after close"


PROBE = ReserveProbe()
