"""The machine's limits and kvlab's sane maxima: every size, count and time a user gives is checked against
one of these before anything is allocated, with a one-line error that names the limit."""
from __future__ import annotations

import math
import os
import resource
from typing import Any

from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.validate import check_int, check_number

MAX_MODEL_LEN = 2**22            # tokens per sequence (4M): beyond any released Llama context
MAX_REQUESTS = 1_000_000         # requests in one workload
MAX_SPAN_S = 7 * 24 * 3600.0     # a workload's arrivals span at most a week
MAX_SEED = 2**63 - 1             # the per-request generators keep 63 bits of a seed (common/request.py)
MAX_BUDGET_GB = 100_000.0        # simulated KV budget: 100 TB, far beyond one node's GPU memory
MAX_PROMPT_TOKENS = 2**26        # prompt tokens a trace synthesises in all (as Python ints: ~2.4 GB)
MAX_HASH_ID = 2**64 - 1          # a trace's block hash id (numpy seeds a block from it)
MAX_VOCAB = 2**24                # token ids a model or a synthetic trace draws from (as common/model.py's maxima)
MAX_LINE_BYTES = 2**22           # one line of a JSONL trace (4 MiB holds 400k hash ids); read no further

# the names config.py, sim/cli.py, sim/serve/cli.py and bench/offline.py import; new code imports common/validate.py
check_int_range, check_finite = check_int, check_number


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


def check_seed(name: str, value: Any, error: type[KvlabError] = ConfigError) -> int:
    """A seed in [0, MAX_SEED]: torch seeds -1 as 2**64 - 1 and the per-request generators keep 63 bits
    (common/request.py generator_seed), so only this range gives every seed its own tokens."""
    return check_int(name, value, 0, MAX_SEED, "", error)


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


# -- kvlab serve: what one HTTP request may ask for (docs/reliability.md, "Server limits") --------------------------
MAX_BODY_BYTES = 32 * 2**20      # a request body: 413 beyond it (a 4M-token prompt as ids fits; RSS stays bounded)
MAX_STOP_CHARS = 1024            # one stop string: longer ones are refused (the hold-back scans this window)
MAX_PROMPT_CHARS = 8 * 2**20     # a prompt or all chat contents together, before tokenizing
MAX_N = 128                      # completions per request
MAX_TOKENS = MAX_MODEL_LEN       # max_tokens per completion
KEEP_ALIVE_S = 5                 # an idle keep-alive connection is closed after this (uvicorn timeout_keep_alive)
MAX_PORT = 65535
MAX_HEADER_BYTES = 64 * 2**10    # request line and headers (uvicorn h11_max_incomplete_event_size)
