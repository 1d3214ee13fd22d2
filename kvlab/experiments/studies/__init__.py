"""Studies: kernel fallbacks, memory saved by sharing, prefix-cache savings by unit size."""
