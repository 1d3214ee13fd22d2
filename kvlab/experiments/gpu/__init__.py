"""The GPU smoke check (run through experiments/gpu_check.sh)."""
