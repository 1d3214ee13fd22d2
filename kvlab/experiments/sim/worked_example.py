"""`kvlab simulate --worked-example`: the seed article's hand examples, computed by the backends' own
accounting (accounting-only caches sized for Llama 3 8B, 128 KiB of KV per token, maximum length 4,096)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlab.common.config import make_config
from kvlab.common.kv.seam import Allocator, create_cache
from kvlab.common.sequence import Sequence
from kvlab.experiments.reporting.tables import table
from kvlab.experiments.sim.roofline import model_spec

EXAMPLE_LENGTHS = (37, 1203, 450)
MAX_LEN = 4096
BLOCK = 16
BUDGET = 60_000_000_000


@dataclass(slots=True)
class Figure:
    name: str
    ours: float
    article: float
    show: Callable[[float], str]
    tolerance: float = 0.0            # for the article's "about" figures

    @property
    def matches(self) -> bool:
        """Equal at the precision the article prints (or within `tolerance` of an approximate figure)."""
        if self.tolerance:
            return abs(self.ours - self.article) <= self.tolerance
        return self.show(self.ours) == self.show(self.article)


def _cache(backend: str, budget: int = BUDGET) -> Allocator:
    config = make_config(backend=backend, block_size=BLOCK, kv_cache_bytes=budget, max_model_len=MAX_LEN,
                         max_num_seqs=MAX_LEN, max_num_batched_tokens=MAX_LEN, dtype="bfloat16",
                         reserve_mode="max", watermark=0.0)
    return create_cache(config, model_spec("llama3-8b").kv_shape(), accounting_only=True).allocator


def _hold(cache: Allocator, lengths: tuple[int, ...], first_id: int = 0) -> list[Sequence]:
    seqs = [Sequence(first_id + i, f"ex{first_id + i}", [0] * n, max_tokens=1) for i, n in enumerate(lengths)]
    for s in seqs:
        cache.allocate(s, s.num_tokens)
    return seqs


def _fill(cache: Allocator, lengths: tuple[int, ...]) -> int:
    """How many sequences, cycling through `lengths`, fit before the cache refuses the next one."""
    count = 0
    while True:
        seq = Sequence(count, f"fill{count}", [0] * lengths[count % len(lengths)], max_tokens=1)
        if cache.allocate(seq, seq.num_tokens) is None:
            return count
        count += 1


def _utilization(cache: Allocator) -> tuple[float, int, int]:
    s = cache.stats()
    return s.live_tokens / s.allocated_token_slots, s.allocated_token_slots, s.used_units


def worked_example() -> list[Figure]:
    gb = lambda x: f"{x / 1e9:.2f} GB"
    mb = lambda x: f"{x / 1e6:.0f} MB"
    pct = lambda x: f"{100 * x:.1f}%"
    count = lambda x: f"{x:,.0f}"
    per_token = model_spec("llama3-8b").kv_bytes_per_token

    reserve, paged = _cache("reserve"), _cache("paged")
    _hold(reserve, EXAMPLE_LENGTHS)
    u_res, slots_res, _ = _utilization(reserve)
    waste = []
    for i, n in enumerate(EXAMPLE_LENGTHS):     # per-sequence waste from the growth in allocated slots
        before = paged.stats().allocated_token_slots
        _hold(paged, (n,), first_id=i)
        waste.append(paged.stats().allocated_token_slots - before - n)
    u_pag, slots_pag, blocks = _utilization(paged)

    # the accounting example: mean live length 1,000; worst case leaves b - 1 = 15 slots empty (1,009 tokens)
    worst, res_1000 = _cache("paged"), _cache("reserve")
    _hold(worst, (1009,))
    _hold(res_1000, (1000,))

    figures = [
        Figure("reserve: slots for 3 sequences", slots_res, 12_288, count),
        Figure("reserve: bytes", slots_res * per_token, 1.61e9, gb),
        Figure("reserve: utilisation (1,690 live tokens)", u_res, 0.138, pct),
        Figure("paged b=16: blocks", blocks, 108, count),
        Figure("paged b=16: slots", slots_pag, 1_728, count),
        Figure("paged b=16: bytes", slots_pag * per_token, 226e6, mb),
        Figure("paged b=16: waste, 37-token sequence", waste[0], 11, count),
        Figure("paged b=16: waste, 1,203-token sequence", waste[1], 13, count),
        Figure("paged b=16: waste, 450-token sequence", waste[2], 14, count),
        Figure("paged b=16: utilisation", u_pag, 0.978, pct),
        Figure("paged b=16, S~1,000, b-1 slots empty (1,009 tokens)", _utilization(worst)[0], 0.985, pct),
        Figure("reserve 4,096, S=1,000: utilisation", _utilization(res_1000)[0], 0.244, pct),
        Figure("reserve: sequences in 60 GB", _fill(_cache("reserve"), (1,)), 111, count),
        Figure("paged: sequences in 60 GB at these lengths (mean 563)", _fill(_cache("paged"), EXAMPLE_LENGTHS),
               800, count, tolerance=50),
    ]
    return figures


def print_worked_example() -> None:
    rows = [[f.name, f.show(f.ours), ("about " if f.tolerance else "") + f.show(f.article),
             "yes" if f.matches else "NO"] for f in worked_example()]
    print(table(["figure", "kvlab", "article", "same"], rows,
                "Worked example (Llama 3 8B, 131,072 B/token, max length 4,096), by the backends' accounting"))
    print()
