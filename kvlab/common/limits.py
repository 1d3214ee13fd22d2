"""The library's sane maxima for what a user gives the engine: every such size is checked against one of these
before anything is allocated, with a one-line error that names the limit. The machine's own limits are in
common/machine.py; the maxima only the commands use (workloads, traces, the server) in experiments/limits.py."""
from __future__ import annotations

from typing import Any

from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.validate import check_int

MAX_MODEL_LEN = 2**22            # tokens per sequence (4M): beyond any released Llama context
MAX_SEED = 2**63 - 1             # the per-request generators keep 63 bits of a seed (common/request.py)


def check_seed(name: str, value: Any, error: type[KvlabError] = ConfigError) -> int:
    """A seed in [0, MAX_SEED]: torch seeds -1 as 2**64 - 1 and the per-request generators keep 63 bits
    (common/request.py generator_seed), so only this range gives every seed its own tokens."""
    return check_int(name, value, 0, MAX_SEED, "", error)
