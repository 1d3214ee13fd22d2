"""The KV-cache seam: what a backend is (shape, stats, allocator and storage sides) and the registry that finds
backends by name without `common` importing any of them."""
