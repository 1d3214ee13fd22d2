"""This machine's limits, probed when asked (RAM, address space, CPUs), the checks a request for memory makes
against them (one-line errors), and byte sizes written for people."""
from __future__ import annotations

import math
import os
import resource

from kvlab.common.errors import ConfigError


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


def address_space_left() -> float:
    """Bytes this process may still map under RLIMIT_AS (`ulimit -v`): the limit less what is mapped now; inf
    without a limit. torch would otherwise fail the pool's allocation with a traceback."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return math.inf
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, ValueError, StopIteration):
        mapped = 0
    return max(0, soft - mapped)


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


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
        left = address_space_left()
        if kv_cache_bytes > left:
            raise ConfigError(f"kv_cache_bytes {kv_cache_bytes:,} is more than this process may still map "
                              f"({fmt_bytes(left)} left under its address-space limit, ulimit -v); {fix}")
