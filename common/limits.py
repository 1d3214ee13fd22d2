"""The machine's limits and kvlab's sane maxima: every size, count and time a user gives is checked against
one of these before anything is allocated, with a one-line error that names the limit."""
from __future__ import annotations

import math
import os

from kvlab.common.errors import ConfigError

MAX_MODEL_LEN = 2**22            # tokens per sequence (4M): beyond any released Llama context
MAX_REQUESTS = 1_000_000         # requests in one workload
MAX_SPAN_S = 7 * 24 * 3600.0     # a workload's arrivals span at most a week
MAX_SEED = 2**63 - 1             # torch and numpy both take seeds below 2**63
MAX_BUDGET_GB = 100_000.0        # simulated KV budget: 100 TB, far beyond one node's GPU memory


def ram_bytes() -> int:
    """Physical memory of this machine (MemTotal, else sysconf)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def max_threads() -> int:
    """Torch threads beyond 4 per CPU only add contention."""
    return 4 * (os.cpu_count() or 1)


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_finite(name: str, value: float, low: float = 0.0, high: float = math.inf, strict: bool = False) -> None:
    """`value` is a number, finite, >= low (> low when strict) and <= high."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if strict else value >= low) and value <= high
    if not ok:
        bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


def check_int_range(name: str, value: int, low: int, high: int, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high:,}]{why}, got {value!r}")


def check_fits_in_ram(what: str, nbytes: float, fix: str) -> None:
    """Refuse an allocation of `nbytes` of host memory larger than this machine's RAM."""
    ram = ram_bytes()
    if nbytes > ram:
        raise ConfigError(f"{what} needs {fmt_bytes(nbytes)}, more than this machine's RAM ({fmt_bytes(ram)}); {fix}")


def check_physical_budget(device: str, kv_cache_bytes: int, fix: str = "lower kv_cache_bytes") -> None:
    """A real (not accounting-only) cache backs kv_cache_bytes with memory: on the CPU that is RAM. A virtual
    reservation may exceed it; the physical pool may not."""
    if device == "cpu":
        check_fits_in_ram(f"kv_cache_bytes {kv_cache_bytes:,}", kv_cache_bytes, fix)
