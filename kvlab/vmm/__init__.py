"""vAttention-style backend: contiguous virtual KV tensors, physical pages mapped on demand."""
