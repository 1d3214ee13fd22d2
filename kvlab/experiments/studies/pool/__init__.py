"""`kvlab study pool`: the same KV memory as one shared pool for vmm servers or static splits, under
phase-shifted bursts (docs/pool-ab.md)."""
