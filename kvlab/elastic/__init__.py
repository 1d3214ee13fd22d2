"""The elastic backend: paged's block tables over a block pool whose memory is mapped on demand (docs/architecture.md)."""
