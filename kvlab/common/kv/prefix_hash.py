"""Chained prefix hashes shared by the backends' prefix caches: a unit (paged block, vmm page) of `unit` tokens
is named by hash(parent hash, adapter id, its token ids), so equal hashes mean equal prefixes up to collisions,
which callers catch by comparing the stored key."""
from __future__ import annotations

from collections.abc import Callable, Iterator

BlockKey = tuple[int | None, str, tuple[int, ...]]   # (parent hash, adapter id, token ids of the unit)
HashFn = Callable[[BlockKey], int]


def default_hash(key: BlockKey) -> int:
    return hash(key)


def chain_keys(token_ids: list[int], adapter_id: str, block_size: int, num_blocks: int,
               first_block: int = 0, parent: int | None = None,
               hash_fn: HashFn = default_hash) -> Iterator[tuple[int, BlockKey]]:
    """Yield (hash, key) of full units first_block..num_blocks-1; `parent` is the hash of the unit before."""
    for i in range(first_block, num_blocks):
        key = (parent, adapter_id, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        parent = hash_fn(key)
        yield parent, key
