"""Prefix caching on the vmm allocator: which pages of the live sequences to register in the cache
(vmm/prefix.py), and a new sequence's slot with its cached leading pages aliased in (mapped again at the same page
indices: the fork path, copy-on-write if written).
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.common.sequence import Sequence
    from kvlab.vmm.pages import SlotPages
    from kvlab.vmm.prefix import PagePrefixCache
    from kvlab.vmm.slots import Slot, SlotTable


class PrefixAliases:
    """The cache, the live sequences whose computed pages it registers, and the tokens its hits saved."""

    def __init__(self, cache: PagePrefixCache, table: SlotTable, pages: SlotPages) -> None:
        self.cache, self.table, self.pages = cache, table, pages
        self.owners: dict[int, Sequence] = {}   # the live sequences, to register their pages
        self.hit_tokens = 0

    def units_to_admit(self, seq: Sequence, num_tokens: int, need: int) -> int:
        """`need` pages less the hits mapped in another slot (free); idle hits still cost a unit each."""
        hits = self.match(seq, num_tokens)
        return need - len(hits) + self.cache.idle_hits(hits)

    def match(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Cached leading pages of a new sequence, after registering what live sequences computed since their
        last allocate (as paged does: a prompt admitted next to its twin still hits)."""
        for owner in self.owners.values():
            slot = self.table.of(owner.seq_id)
            if slot is not None:
                self.register(owner, slot)
        return self.cache.match(seq, num_tokens)

    def register(self, seq: Sequence, slot: Slot) -> None:
        """Make the sequence's computed full pages findable by later prompts."""
        self.cache.register(seq, slot.groups, min(seq.num_computed_tokens, slot.held, seq.num_tokens))

    def claim(self, seq: Sequence, num_tokens: int) -> tuple[Slot, int]:
        """A slot for a first allocation, with its cached prefix pages aliased in; returns it and the hit tokens."""
        hits = self.match(seq, num_tokens)
        self.owners[seq.seq_id] = seq
        if not hits:
            return self.table.claim(seq.seq_id, num_tokens), 0
        tokens = len(hits) * self.cache.tokens_per_page
        alias = partial(self.pages.alias, groups=[g for g, _ in hits], tokens=tokens)
        try:
            slot = self.pages.new_slot(seq.seq_id, num_tokens, alias, fewest_pages=True)
        except BaseException:
            self.forget(seq.seq_id)
            raise
        self.cache.adopt(seq.seq_id, [h for _, h in hits])
        self.hit_tokens += tokens
        return slot, tokens

    def track(self, seq: Sequence) -> None:
        """A sequence holds a slot again (swapped in): register its pages from now on."""
        self.owners[seq.seq_id] = seq

    def fork(self, parent: Sequence, source: Slot, child: Sequence) -> None:
        """The child maps the parent's pages: it starts with the parent's registered chain."""
        self.register(parent, source)
        self.cache.adopt(child.seq_id, self.cache.chains.get(parent.seq_id, []))
        self.owners[child.seq_id] = child

    def forget(self, seq_id: int) -> None:
        """The sequence no longer maps its pages (freed, swapped out)."""
        self.cache.forget(seq_id)
        self.owners.pop(seq_id, None)

    def stats(self) -> dict[str, Any]:
        cache = self.cache
        return {"prefix_caching": "on", "prefix_cached_pages": len(cache), "prefix_idle_pages": len(cache.idle),
                "prefix_evictions": cache.evictions, "prefix_hash_collisions": cache.collisions}
