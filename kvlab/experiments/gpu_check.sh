#!/usr/bin/env bash
# The prepared GPU check: run from anywhere on a machine with an NVIDIA GPU; installs nothing.
#   bash experiments/gpu_check.sh                  # on the GPU machine (exits 2, saying why, without a GPU)
#   bash experiments/gpu_check.sh --dry-run-cpu    # every part on CPU: fake CUDA driver, Triton interpreter
#   bash experiments/gpu_check.sh --first-contact  # the ~90 s first-contact selection of the parts instead
#   bash experiments/gpu_check.sh --parts environment,cuda_vmm   # any parts (see experiments/gpu/check.py)
# Writes one JSON: $OUT/gpu_check.json if OUT is set, else results/gpu_check.json (or --out PATH);
# --first-contact writes first_contact.json in the same places.
# Interpreter: $PYTHON if set, else the project's .venv/bin/python if there is one, else python3; with
# PYTHONPATH=<repo root>, so a bare image with torch preinstalled needs no install step. Each part runs in its
# own subprocess with its own timeout; the whole run is cut at 475 s (the JSON keeps every finished part).
set -u
cd "$(dirname "$0")/.." && { [ -f pyproject.toml ] || cd ..; }   # experiments/ or kvlab/experiments/
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
echo "gpu_check: using $py" >&2
exec timeout --kill-after=5 475 "$py" experiments/gpu/check.py "$@"
