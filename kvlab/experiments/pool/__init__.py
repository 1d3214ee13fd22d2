"""`kvlab pool`: create, inspect and limit a machine-wide KV page pool (kvlab.vmm.pool, docs/pool.md)."""
