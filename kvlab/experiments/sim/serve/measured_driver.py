"""`--driver-costs measured:FILE`: a driver profile from the GPU check's vmm_sizes part (experiments/gpu/
parts_vmm_sizes.py): per-call seconds of cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap against the bytes
one call covers (one handle per range), in `gpu_check.json` (parts.vmm_sizes.result.driver_figures) or a
figures file of its own. A page of P bytes pays the per-call figures at P, interpolated linearly in log2(bytes)
between measured sizes; below the smallest measured size (2 MiB: stock CUDA has no smaller page) the smallest
size's figures, which every table marks as an extrapolation (costs.extrapolated)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError

PREFIX = "measured:"
FORMAT = "kvlab-driver-figures/1"
CALLS = ("create_s", "map_s", "set_access_s", "unmap_s")


def is_measured(name: str) -> bool:
    return name.startswith(PREFIX) and len(name) > len(PREFIX)


def measured_figures(name: str) -> tuple[str, dict[int, dict[str, float]]]:
    """(source, {bytes: {call: seconds}}) from `measured:FILE`; every fault is one line."""
    path = Path(name[len(PREFIX):])
    if not path.is_file():
        raise ConfigError(f"no driver figures at {path}: the GPU check writes them (experiments/gpu_check.sh)")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"driver figures {path} are not JSON: {exc}") from None
    doc = figures_in_check(doc, path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{path} holds no driver figures (want \"format\": \"{FORMAT}\")")
    points = doc.get("points")
    if not isinstance(points, list) or not points:
        raise ConfigError(f"{path}: driver figures without points")
    table = {}
    for row in points:
        size = number(row, "bytes", path)
        table[int(size)] = {call: number(row, call, path, zero_ok=True) for call in CALLS}
    return f"{doc.get('source', 'measured')} ({path})", table


def figures_in_check(doc: Any, path: Path) -> Any:
    """A gpu_check.json's figures (its vmm_sizes part's result); any other document as it is."""
    if not (isinstance(doc, dict) and "parts" in doc):
        return doc
    part = doc["parts"].get("vmm_sizes") if isinstance(doc["parts"], dict) else None
    if not isinstance(part, dict) or not part.get("ok"):
        raise ConfigError(f"{path} is a GPU check without a successful vmm_sizes part")
    return (part.get("result") or {}).get("driver_figures")


def number(row: Any, key: str, path: Path, zero_ok: bool = False) -> float:
    value = row.get(key) if isinstance(row, dict) else None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{path}: driver figure {key} must be a {'non-negative' if zero_ok else 'positive'} "
                          f"number, got {value!r}")
    return float(value)


def at_size(table: dict[int, dict[str, float]], size: int | None) -> dict[str, float]:
    """Each call's seconds at `size` bytes (None: the smallest measured size)."""
    sizes = sorted(table)
    if size is None or size <= sizes[0]:
        return table[sizes[0]]
    if size >= sizes[-1]:
        return table[sizes[-1]]
    hi = next(i for i, s in enumerate(sizes) if s >= size)
    lo_s, hi_s = sizes[hi - 1], sizes[hi]
    w = (math.log2(size) - math.log2(lo_s)) / (math.log2(hi_s) - math.log2(lo_s))
    return {call: table[lo_s][call] * (1 - w) + table[hi_s][call] * w for call in CALLS}
