"""Paged attention kernels, all `fn(q, k_cache, v_cache, meta, scale) -> out`: the torch gather reference,
Triton, torch FlexAttention, and the flash-attn and FlashInfer adapters (declared in paged/kernel_declarations.py,
which the paged spec names)."""
