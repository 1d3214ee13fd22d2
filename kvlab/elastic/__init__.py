"""The elastic backend: paged's block tables over a block pool mapped on demand (docs/architecture.md)."""
