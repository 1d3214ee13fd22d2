#!/usr/bin/env bash
# The prepared GPU check: run from anywhere on a machine with an NVIDIA GPU; installs nothing.
#   bash experiments/gpu_check.sh                # on the GPU machine (falls back to the CPU dry run without one)
#   bash experiments/gpu_check.sh --dry-run-cpu  # every part on CPU: fake CUDA driver, Triton interpreter
# Writes one JSON: $OUT/gpu_check.json if OUT is set, else results/gpu_check.json (or --out PATH).
# Uses python3 (or $PYTHON) with PYTHONPATH=<repo root>; no virtual environment needed. Each part runs in its
# own subprocess with its own timeout; the whole run is cut at 475 s (the JSON keeps every finished part).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=5 475 "${PYTHON:-python3}" experiments/gpu_check.py "$@"
