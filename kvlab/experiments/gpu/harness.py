"""How the GPU check runs a part: in its own subprocess (its own process group, so a timeout kills its
children too) with its own timeout; the part writes its result file, which is kept even when the process is
killed afterwards (a part that faulted on purpose may hang in CUDA teardown after recording the fault)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
PART_TIMEOUT_ENV = "KVLAB_GPU_CHECK_PART_SECONDS"     # tells a part its own timeout
CHECK_SCRIPT = Path(__file__).resolve().with_name("check.py")


def part_env(dry: bool, timeout: float) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env[PART_TIMEOUT_ENV] = str(int(timeout))
    env["TRITON_INTERPRET"] = "1" if dry else "0"   # compiled kernels on the GPU; the interpreter on CPU
    return env


def run_part(name: str, dry: bool, timeout: float) -> dict[str, Any]:
    """One part of the check in its own subprocess, with its own timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "part.json"
        cmd = [sys.executable, str(CHECK_SCRIPT), "--part", name, "--part-out", str(result_file)]
        cmd += ["--dry-run-cpu"] if dry else []
        return run_subprocess(cmd, part_env(dry, timeout), timeout, result_file)


def run_subprocess(cmd: list[str], env: dict[str, str], timeout: float, result_file: Path) -> dict[str, Any]:
    """Run one part's process and return the result file it wrote, also when it was killed afterwards."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        timed_out = True
    seconds = round(time.perf_counter() - t0, 2)
    doc = read_result(result_file)
    if doc is not None:
        doc["seconds"] = seconds
        if timed_out:
            doc["timed_out"] = f"killed after {timeout:.0f} s, after it had written its result"
        return doc
    why = f"timed out after {timeout:.0f} s" if timed_out else f"the part process exited with {proc.returncode}"
    return {"ok": False, "error": f"{why} and wrote no result", "seconds": seconds,
            "stderr_tail": (stderr or "")[-2000:]}


def read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_result(path: Path, doc: dict[str, Any]) -> None:
    """Atomically: a part killed while writing leaves no half file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def run_one(part: Callable[[bool], dict[str, Any]], dry: bool, out_file: Path) -> int:
    """Inside a part's subprocess: run it, write {"ok", "result" | "error"}."""
    try:
        result = part(dry)
        doc = {"ok": "failed" not in result, "result": result}
        if "failed" in result:
            doc["error"] = result["failed"]
    except Exception as exc:  # noqa: BLE001 - the error is the result
        doc = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    write_result(out_file, doc)
    return 0


class CheckDoc:
    """The check's JSON document, rewritten after every part so a killed run keeps what it had."""

    def __init__(self, path: Path, dry: bool, selection: str) -> None:
        self.path = path
        self.start = time.perf_counter()
        self.doc: dict[str, Any] = {"mode": "cpu-dry-run" if dry else "gpu", "why": "", "selection": selection,
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def record(self, name: str, result: dict[str, Any]) -> None:
        self.doc["parts"][name] = result
        self.save()

    def save(self) -> None:
        self.doc["seconds"] = round(self.elapsed(), 1)
        write_result(self.path, self.doc)
