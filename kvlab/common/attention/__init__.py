"""Attention in one place, one idea per module:

- spec: AttentionSpec, what a kernel's rules look at;
- metadata: the per-step metadata a backend builds and every kernel reads;
- rules: what each kernel's library supports (and triton_tiles: the Triton kernel's tiles and shared memory);
- declarations: one KernelDecl per kernel (layout, implementation, package, rules);
- priority: the per-device order `kernel="auto"` follows;
- bounds: the metadata's bounds checks, run before any run-time fallback;
- dispatch: the dispatcher backends build with `make_dispatcher`, with its run-time fallback;
- contiguous, flash_attn_contiguous: the contiguous kernels shared by the vmm and reserve backends.
"""
