"""kvlab: compare KV-cache memory managers (vAttention-style VMM, PagedAttention, reservation) under one
scheduler and one model runner.

    from kvlab import LLM, SamplingParams, EngineConfig

The subpackages `kvlab.common`, `kvlab.vmm`, `kvlab.paged` and `kvlab.experiments` live in the repository's
top-level folders of the same names; pyproject's package-dir maps them under this one import name, so nothing
generic lands at the top of site-packages.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["LLM", "EngineConfig", "SamplingParams"]

# A source checkout run without installing (the GPU check on a bare image): the subpackages sit beside this
# folder. Only a kvlab checkout is added, never an arbitrary parent directory.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "vmm" / "__init__.py").is_file() \
        and str(_checkout) not in __path__:
    __path__.append(str(_checkout))


def __getattr__(name: str) -> Any:  # lazy: `import kvlab` stays light for the CLI and tests
    if name == "LLM":
        from kvlab.common.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvlab.common.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from kvlab.common.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
