"""Experiments: the A/B bench, the roofline simulator, the kernel-fallback study, the CLI."""
