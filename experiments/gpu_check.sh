#!/usr/bin/env bash
# The prepared GPU check: run from anywhere on a machine with an NVIDIA GPU; installs nothing.
#   bash experiments/gpu_check.sh                # on the GPU machine (falls back to the CPU dry run without one)
#   bash experiments/gpu_check.sh --dry-run-cpu  # every part on CPU: fake CUDA driver, Triton interpreter
# Writes one JSON: $OUT/gpu_check.json if OUT is set, else results/gpu_check.json (or --out PATH).
# Uses $PYTHON, else the project's .venv/bin/python when `make` created it, else python3, with
# PYTHONPATH=<repo root>; no virtual environment needs activating. Each part runs in its
# own subprocess with its own timeout; the whole run is cut at 475 s (the JSON keeps every finished part).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
echo "gpu_check: using $PYTHON" >&2
exec timeout --kill-after=5 475 "$PYTHON" experiments/gpu_check.py "$@"
