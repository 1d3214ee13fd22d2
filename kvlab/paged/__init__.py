"""PagedAttention backend: block pool, block tables, copy-on-write, paged kernels."""
