"""Attention in one place: per-step metadata, kernel declarations and library rules, the per-device priority,
the dispatcher with its runtime fallback, and the contiguous kernels shared by the vmm and reserve backends."""
