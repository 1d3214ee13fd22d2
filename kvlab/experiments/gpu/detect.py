"""Is there a GPU? Decided before any part of the check runs, never by a part's result: `nvidia-smi -L`, or,
where it cannot answer, torch.cuda.device_count() in a fresh process with a generous timeout."""
from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

from kvlab.common.validate import is_digits

NVIDIA_SMI_SECONDS = 30
TORCH_PROBE_SECONDS = 180    # a cold torch import plus the first CUDA init on a fresh machine


def nvidia_smi_gpus(timeout: float = NVIDIA_SMI_SECONDS) -> tuple[list[str] | None, str]:
    """The GPUs `nvidia-smi -L` lists; None when it cannot answer (absent, failed, timed out)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi is not on PATH"
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi -L did not answer: {exc}"
    gpus = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("GPU ")]
    if proc.returncode != 0 and not gpus:
        first = (proc.stdout + proc.stderr).strip().splitlines()
        return None, f"nvidia-smi -L exited with {proc.returncode}: {first[0] if first else 'no output'}"
    return gpus, f"nvidia-smi -L lists {len(gpus)} GPU(s)"


def torch_probe(timeout: float = TORCH_PROBE_SECONDS) -> tuple[int | None, str]:
    """torch.cuda.device_count() in a fresh process; None when the probe itself failed."""
    code = "import torch; print(torch.cuda.device_count())"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, f"the torch probe did not finish in {timeout:.0f} s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not is_digits(lines[-1]):
        tail = proc.stderr.strip().splitlines()
        return None, f"the torch probe failed: {tail[-1] if tail else proc.returncode}"
    return int(lines[-1]), f"torch.cuda.device_count() = {lines[-1]}"


def detect_gpu() -> dict[str, Any]:
    """nvidia-smi first; the torch probe only where nvidia-smi lists nothing."""
    gpus, smi = nvidia_smi_gpus()
    if gpus:
        return {"present": True, "gpus": gpus, "evidence": [smi]}
    count, probe = torch_probe()
    return {"present": bool(count), "gpus": [], "evidence": [smi, probe]}
