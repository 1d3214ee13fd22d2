"""The kernel term: attention time per step as a function of the KV layout (contiguous over a slot, or paged
through a block table of `block_size` tokens), phase, batch, context lengths, heads, head_dim and KV dtype.

Every item of a step has an ideal attention time on the roofline: its attended K/V bytes over the bandwidth
(decode), or the larger of that and its attention FLOPs at the mfu (prefill, when prefill is modelled). Heads,
head_dim, dtype and the batch's contexts enter there. A kernel profile multiplies it by the paged layout's
slowdown over the contiguous one, `ratio(phase, block_size, context)`; the contiguous layout runs at the ideal.

Profiles (`--kernel-costs`): `none` (no kernel term: today's roofline, exactly), the published ones, one per
source and kernel family (sim/kernel_evidence.py; each figure's source in docs/evidence.md), `cpu` (`kvlab
calibrate --kernels` on this machine), `measured:FILE` (the same measurement from the GPU check: a kernel
profile, or the gpu_check.json holding one). Between measured points the ratio is interpolated linearly in
log2(context) and log2(block size), and held at the nearest end beyond.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.sim.kernel_profile import FORMAT, KernelProfile, Point

PHASES = ("decode", "prefill")
DEFAULT_KERNEL_PROFILE = Path("results") / "calibrate" / "kernels.json"
CHOICES = "none | central | fa2-same-kernel | vllm-vs-ft | fa4-blocks | vattention-vs-vllm | cpu | measured:FILE"


def kernel_profile(spec: str) -> KernelProfile | None:
    """none -> None (no kernel term); a published profile (sim/kernel_evidence.py, docs/evidence.md); cpu (the
    default calibration file); measured:FILE."""
    from kvlab.experiments.sim.kernel_evidence import published_profile
    if spec == "none":
        return None
    found = published_profile(spec)
    if found is not None:
        return found
    if spec == "cpu":
        return read_profile(DEFAULT_KERNEL_PROFILE, "cpu", "run `kvlab calibrate --kernels` first")
    kind, _, path = spec.partition(":")
    if kind == "measured" and path:
        return read_profile(Path(path), "measured", "the GPU check writes it (experiments/gpu_check.sh)")
    raise ConfigError(f"unknown --kernel-costs {spec!r}; choose {CHOICES}")


def read_profile(path: Path, name: str, hint: str) -> KernelProfile:
    """A kernel profile file, or a gpu_check.json whose kernel_costs part holds one; every fault is one line."""
    if not path.is_file():
        raise ConfigError(f"no kernel profile at {path}: {hint}")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:   # RecursionError: nested too deeply
        raise ConfigError(f"kernel profile {path} is not JSON: {str(exc)[:120] or type(exc).__name__}") from None
    doc = _profile_in_check(doc, path)
    try:
        return parse_profile(doc, name)
    except ConfigError as exc:
        raise ConfigError(f"bad kernel profile {path}: {exc}") from None


def _profile_in_check(doc: Any, path: Path) -> Any:
    """A gpu_check.json's profile (its kernel_costs part's result); any other document as it is."""
    if not (isinstance(doc, dict) and "parts" in doc):
        return doc
    part = _field(doc, "parts", "kernel_costs")
    if not _field(part, "ok"):
        raise ConfigError(f"{path} is a GPU check without a successful kernel_costs part")
    return _field(part, "result", "profile")


def _field(doc: Any, *keys: str) -> Any:
    for key in keys:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def parse_profile(doc: Any, name: str) -> KernelProfile:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"not a kernel profile (want \"format\": \"{FORMAT}\")")
    rows = doc.get("points")
    if not isinstance(rows, list) or not rows:
        raise ConfigError("no points")
    points = tuple(parse_point(row) for row in rows)
    missing = [phase for phase in PHASES if phase not in {p.phase for p in points}]
    if missing:
        raise ConfigError(f"no {' or '.join(missing)} points")
    return KernelProfile(name, str(doc.get("source", "")), points)


def parse_point(row: Any) -> Point:
    """One point: phase, block_size, context, and ratio (or paged_s and contiguous_s to divide)."""
    if not isinstance(row, dict):
        raise ConfigError(f"point {row!r} is not an object")
    if row.get("phase") not in PHASES:
        raise ConfigError(f"point phase {row.get('phase')!r} is not one of {', '.join(PHASES)}")
    ratio = row.get("ratio")
    if ratio is None and "paged_s" in row and "contiguous_s" in row:
        ratio = _positive(row, "paged_s") / _positive(row, "contiguous_s")
    row = {**row, "ratio": ratio}
    return Point(row["phase"], int(_positive(row, "block_size")), int(_positive(row, "context")),
                 _positive(row, "ratio"))


def _positive(row: dict, key: str) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"point {key} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class KernelTerm:
    """One backend's attention kernels under a profile: paged layouts pay the profile's ratio at their block
    size; contiguous layouts run at the ideal."""
    profile: KernelProfile
    layout: str              # "paged" | "contiguous" (the backend spec's layout)
    block_size: int = 0      # paged: tokens per block

    def factor(self, phase: str, context: int) -> float:
        if self.layout != "paged":
            return 1.0
        return self.profile.ratio(phase, self.block_size, context)
