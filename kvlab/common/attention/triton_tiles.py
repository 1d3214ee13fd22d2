"""The Triton paged kernel's tile plan and the shared memory it needs, without importing triton: the kernel
(paged/kernels/triton_paged.py) launches with these tiles and the registry's rule refuses a shape whose tiles
cannot fit a thread block, so it is refused up front instead of failing at launch."""
from __future__ import annotations

TILE_N = 32          # keys per inner iteration
PREFILL_ROWS = 64    # target query rows (tokens x group heads) per prefill program
MIN_DOT = 16         # every tl.dot dimension is >= 16 when compiled
# Per-program scratch beside the dot operands (row max/sum reductions); with the operands below it reproduces
# the one measured point: compiled fp32, head_dim 512, prefill asked for 270,848 B on an H200.
SCRATCH_BYTES = 512
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def head_pad(head_dim: int) -> int:
    """The head dim the kernel computes with: a power of two, at least 16 for tl.dot."""
    return max(MIN_DOT, next_power_of_2(head_dim))


def tiling(group: int, decode: bool) -> tuple[int, int]:
    """(BLOCK_Q, GROUP_PAD): query tokens per program and padded group, with BLOCK_Q * GROUP_PAD >= 16."""
    group_pow2 = next_power_of_2(group)
    block_q = 1 if decode else max(1, PREFILL_ROWS // group_pow2)
    return block_q, max(group_pow2, MIN_DOT // block_q)


def shared_memory_bytes(head_dim: int, group: int, decode: bool, dtype: str) -> int:
    """Estimated shared memory of one program: the dot operands Q [rows, D], K and V [TILE_N, D] in the cache
    dtype, P [rows, TILE_N] in fp32, plus the reduction scratch. Measured for fp32 only (half precision: the
    same model with 2-byte operands, unconfirmed on a GPU; a launch that still fails falls back at run time)."""
    block_q, group_pad = tiling(group, decode)
    rows, d = block_q * group_pad, head_pad(head_dim)
    return DTYPE_BYTES[dtype] * (rows * d + 2 * TILE_N * d) + 4 * rows * TILE_N + SCRATCH_BYTES
