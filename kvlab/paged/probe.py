"""What the invariant tests check inside the paged backend, through public state only: the allocator's
snapshot() and the storage's pool tensor."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.sequence import Sequence

# the test shape (2 layers, 2 KV heads, head_dim 32, float32) stores 1024 bytes per token
TEST_TOKEN_BYTES = 1024


class PagedProbe:
    test_options: dict[str, Any] = {"block_size": 4, "kv_cache_bytes": 24 * 4 * TEST_TOKEN_BYTES}  # 24 blocks

    def read(self, cache: KVCache, seq: Sequence, n: int) -> torch.Tensor:
        """Gather straight from the pool tensor [2, L, blocks, block_size, H_kv, D] through the block table."""
        snap = cache.allocator.snapshot()
        size = snap["block_size"]
        pos = torch.arange(n)
        blocks = torch.tensor(snap["tables"][seq.seq_id], dtype=torch.int64)[pos // size]
        return cache.storage.kv[:, :, blocks, pos % size].transpose(0, 1)

    def check_structure(self, cache: KVCache, live: dict[int, Sequence], swapped: set[int],
                        may_share: Callable[[int, int, int], bool]) -> None:
        snap = cache.allocator.snapshot()
        tables, size = snap["tables"], snap["block_size"]
        assert set(tables) == set(live), f"block tables {sorted(tables)} != live {sorted(live)}"
        assert set(snap["swapped"]) == swapped, f"swapped {snap['swapped']} != {sorted(swapped)}"
        users: dict[int, list[tuple[int, int]]] = defaultdict(list)   # block -> (seq_id, logical index)
        for sid, seq in live.items():
            assert len(tables[sid]) >= -(-seq.num_computed_tokens // size), f"seq {sid}: computed tokens unbacked"
            for j, block in enumerate(tables[sid]):
                if block >= 0:   # -1: dropped below a sliding window, back in the pool
                    users[block].append((sid, j))
        self._check_counts(snap, users)
        for block, refs in users.items():
            (sid0, j0), rest = refs[0], refs[1:]
            for sid, j in rest:
                assert j == j0, f"block {block} sits at logical index {j0} of seq {sid0} but {j} of seq {sid}"
                assert may_share(sid0, sid, j), f"block {block} shared by unrelated sequences {sid0} and {sid}"
        assert cache.allocator.stats().used_units == sum(1 for c in snap["ref_counts"] if c > 0)

    @staticmethod
    def _check_counts(snap: dict[str, Any], users: dict[int, list[tuple[int, int]]]) -> None:
        counts, free = snap["ref_counts"], set(snap["free_blocks"])
        for block in range(snap["num_blocks"]):
            assert counts[block] == len(users.get(block, ())), (
                f"block {block}: refcount {counts[block]}, referenced by {users.get(block, [])}")
            assert (block in free) == (counts[block] == 0), f"block {block}: free flag vs refcount"

    def window_units(self, cache: KVCache) -> dict[int, tuple[int, list[int]]]:
        """Per live sequence: the table's leading entries the window dropped (-1), and the blocks it holds."""
        tables = cache.allocator.snapshot()["tables"]
        return {sid: (sum(1 for b in t if b < 0), [b for b in t if b >= 0]) for sid, t in tables.items()}

    def check_drained(self, cache: KVCache) -> None:
        snap = cache.allocator.snapshot()
        assert not snap["tables"] and not snap["swapped"] and not any(snap["ref_counts"]), (
            f"left after draining: tables {sorted(snap['tables'])}, swapped {snap['swapped']}")

    def check_closed(self, cache: KVCache) -> None:
        assert cache.closed, "check_closed runs after cache.close()"
        kv = getattr(cache.storage, "kv", None)   # accounting mode's null storage never had a tensor
        assert kv is None and not getattr(cache.storage, "k_caches", []), "the pool tensor outlived close()"


PROBE = PagedProbe()
