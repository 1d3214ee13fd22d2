"""Measurements on the real engine: the offline A/B bench, calibration, the perf suite."""
