"""Tensor parallelism over torch.distributed: rank 0 (the engine, its scheduler, sampling) drives ranks
1..tp-1 (spawned workers). Each rank holds 1/tp of the attention heads, KV heads and MLP columns, and its
own KV-cache backend instance; rank 0 broadcasts one message per step (that step's allocation operations
and the batch) so every rank's allocator replays the same operations. See docs/tensor-parallel.md."""
