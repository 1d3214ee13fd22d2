"""A kernel profile: the paged layout's attention slowdown over the contiguous one at measured (phase, block size,
context) points, interpolated between them (sim/kernels.py uses it; sim/kernel_evidence.py declares the published
ones)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FORMAT = "kvlab-kernel-profile/1"


@dataclass(frozen=True, slots=True)
class Point:
    """paged time / contiguous time of one phase at one block size and context (batch: what was measured)."""
    phase: str
    block_size: int
    context: int
    ratio: float


@dataclass(frozen=True, slots=True)
class KernelProfile:
    name: str
    source: str
    points: tuple[Point, ...]

    def ratio(self, phase: str, block_size: int, context: int) -> float:
        """The paged slowdown at (phase, block size, context), interpolated between measured points."""
        mine = [p for p in self.points if p.phase == phase]
        blocks = sorted({p.block_size for p in mine})
        return _between(blocks, block_size, lambda b: _over_context(mine, b, context))

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "source": self.source,
                "points": [{"phase": p.phase, "block_size": p.block_size, "context": p.context, "ratio": p.ratio}
                           for p in self.points]}


def _over_context(points: list[Point], block_size: int, context: int) -> float:
    at = {p.context: p.ratio for p in points if p.block_size == block_size}
    return _between(sorted(at), context, at.__getitem__)


def _between(xs: list[int], x: int, value: Any) -> float:
    """value(x) interpolated linearly in log2 between the measured xs around x; the nearest end beyond them."""
    if x <= xs[0]:
        return value(xs[0])
    if x >= xs[-1]:
        return value(xs[-1])
    hi = next(i for i, v in enumerate(xs) if v >= x)
    lo_x, hi_x = xs[hi - 1], xs[hi]
    w = (math.log2(x) - math.log2(lo_x)) / (math.log2(hi_x) - math.log2(lo_x))
    return value(lo_x) * (1 - w) + value(hi_x) * w
