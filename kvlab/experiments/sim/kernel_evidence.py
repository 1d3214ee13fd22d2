"""The kernel profiles built from published figures, one per source and kernel family. docs/evidence.md holds each
figure's source, hardware and exactly what it compares; a profile's `source` says it in one line.

A ratio is paged attention time / contiguous attention time. Where a source compares two different
implementations (a paged kernel of one project against a contiguous kernel of another) the profile says so in its
name and source: such a ratio mixes kernel quality with paging and is not the cost of a block table.

- `central`: the study's default, the most defensible central estimate (docs/evidence.md, "The default"): 1.23 at
  16-token blocks (vLLM's paged kernel against FasterTransformer's contiguous one: an upper bound on paging, as it
  includes the difference between two implementations) falling to 1.0 at 256-token blocks (FlashAttention-2's own
  paged path is not slower than its contiguous path there), in log2 of the block size; held at every context.
- `fa2-same-kernel`: FlashAttention-2's `flash_attn_with_kvcache` with and without a block table (256-token
  blocks): the paged path 7-35% faster, by context. The same kernel: the only same-implementation figure we have.
- `vllm-vs-ft`: vLLM's paged kernel (16-token blocks) against FasterTransformer's contiguous one: 20-26% slower.
- `fa4-blocks`: FlashAttention-4's early paged path (SM100) at pages of 1 / 32 / 128 tokens, against page 128
  (no contiguous figure was published: page 128 is taken as the contiguous time).
- `vattention-vs-vllm` (was `published`): vAttention's contiguous FlashAttention-2 against vLLM v0.2.7's paged
  kernel (decode 1.97x) and against paged FlashInfer (prefill 1.45x): cross-implementation.
Where a source gives only decode, prefill is held at the same ratios (central, vllm-vs-ft) or at 1.0 (fa2-same-kernel,
fa4-blocks: no prefill figure); docs/evidence.md lists each such assumption."""
from __future__ import annotations

import warnings

from kvlab.experiments.sim.kernel_profile import KernelProfile, Point

LEDGER = "docs/evidence.md"


def _both(block: int, context: int, ratio: float) -> tuple[Point, Point]:
    return Point("decode", block, context, ratio), Point("prefill", block, context, ratio)


CENTRAL = KernelProfile(
    "central", f"central estimate ({LEDGER}): 1.23x at 16-token blocks (vLLM paged vs FasterTransformer contiguous, "
               "an upper bound on paging) to 1.0x at 256 (FlashAttention-2 paged vs its own contiguous path), "
               "both phases, every context",
    (*_both(16, 4096, 1.23), *_both(256, 4096, 1.0)))

# Dao-AILab/flash-attention#841, batch 32, MHA: non-paged / paged time 1.076, 1.076, 1.320, 1.346, 1.253 at
# contexts 1K-16K (256-token blocks, the only size FlashAttention-2 accepted); the ratio here is paged / non-paged.
FA2_SAME_KERNEL = KernelProfile(
    "fa2-same-kernel", f"FlashAttention-2 flash_attn_with_kvcache, paged (256-token blocks) vs non-paged, batch 32, "
                       f"MHA, contexts 1K-16K; same kernel; flash-attention#841 ({LEDGER}); prefill: no figure (1.0)",
    (Point("decode", 256, 1024, 0.344 / 0.370), Point("decode", 256, 2048, 0.668 / 0.719),
     Point("decode", 256, 4096, 1.309 / 1.728), Point("decode", 256, 8192, 2.616 / 3.522),
     Point("decode", 256, 16384, 5.548 / 6.953), Point("prefill", 256, 4096, 1.0)))

VLLM_VS_FT = KernelProfile(
    "vllm-vs-ft", f"vLLM paged kernel (16-token blocks) vs FasterTransformer contiguous, 20-26% slower (midpoint "
                  f"1.23x); different implementations; vLLM SOSP'23 §7.1, A100 ({LEDGER}); prefill held at decode's",
    _both(16, 4096, 1.23))

# flash-attention PR #1999 (SM100, batch 4, one query, 131,072-token context, 32 heads, d 128): 9.906 / 6.345 /
# 2.147 ms at pages of 1 / 32 / 128 tokens.
FA4_BLOCKS = KernelProfile(
    "fa4-blocks", f"FlashAttention-4 early paged path, SM100: pages 1 / 32 / 128 relative to page 128 (taken as "
                  f"contiguous: none published); batch 4, 128K context; flash-attention PR #1999 ({LEDGER}); "
                  "prefill: no figure (1.0)",
    (Point("decode", 1, 131072, 9.906 / 2.147), Point("decode", 32, 131072, 6.345 / 2.147),
     Point("decode", 128, 131072, 1.0), Point("prefill", 128, 131072, 1.0)))

VATTENTION_VS_VLLM = KernelProfile(
    "vattention-vs-vllm", f"cross-implementation: vAttention's contiguous FlashAttention-2 vs vLLM v0.2.7's paged "
                          f"kernel, decode throughput up to 1.97x (16K contexts), and vs paged FlashInfer, prefill up "
                          f"to 1.45x; arXiv 2405.04437, A100 ({LEDGER})",
    (Point("decode", 16, 16384, 1.97), Point("prefill", 16, 16384, 1.45)))

PUBLISHED_PROFILES = {p.name: p for p in (CENTRAL, FA2_SAME_KERNEL, VLLM_VS_FT, FA4_BLOCKS, VATTENTION_VS_VLLM)}
ALIASES = {"published": "vattention-vs-vllm"}


def published_profile(name: str) -> KernelProfile | None:
    """A published profile by name (an old name warns and resolves); None when `name` is not one."""
    if name in ALIASES:
        new = ALIASES[name]
        warnings.warn(f"--kernel-costs {name} is now {new!r} (a cross-implementation comparison, {LEDGER})",
                      FutureWarning, stacklevel=3)
        name = new
    return PUBLISHED_PROFILES.get(name)


# Where the published figures sit on the study's curve (paged decode time / contiguous): label, low, high.
MARKS = (("FlashAttention-2 paged vs its own contiguous path (same kernel, #841)", 0.743, 0.930),
         ("vLLM paged vs FasterTransformer contiguous (different kernels, SOSP'23 §7.1)", 1.20, 1.26),
         ("vAttention FA2 vs vLLM v0.2.7 paged (different kernels, decode throughput)", 1.97, 1.97))
