"""One sequence's block table, the record the allocator and the prefix index both read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence

DROPPED = -1   # a table entry whose block fell wholly outside the sliding window and went back to the pool


@dataclass(slots=True)
class SeqBlocks:
    seq: Sequence
    table: list[int]                                   # logical block j -> physical block id
    num_tokens: int = 0                                # tokens the sequence may hold (largest allocate)
    hashes: list[int] = field(default_factory=list)   # chained hashes of its leading registered full blocks
    dropped: int = 0                                   # leading entries the sliding window dropped


def live(table: list[int]) -> list[int]:
    """The table's blocks, without the entries the window dropped."""
    return [b for b in table if b != DROPPED]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
