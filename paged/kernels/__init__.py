"""Paged attention kernels: torch gather reference, Triton, flash-attn and FlashInfer adapters."""
