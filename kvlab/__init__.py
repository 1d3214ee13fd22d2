"""kvlab: compare KV-cache memory managers (vAttention-style VMM, PagedAttention, reservation) under one
scheduler and one model runner.

    from kvlab import LLM, SamplingParams, EngineConfig

The subpackages `kvlab.common`, `kvlab.vmm`, `kvlab.paged` and `kvlab.experiments` live in the repository's
top-level folders of the same names; this folder links to them (kvlab/common -> ../common, ...), so the one import
name resolves by path, for the interpreter and for tools alike, and nothing generic lands at the top of sys.path.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["LLM", "EngineConfig", "SamplingParams"]

# A copy of the checkout that lost its links (an archive tool that drops symlinks): the subpackages still sit
# beside this folder. Only a kvlab checkout is added, never an arbitrary parent directory.
_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "vmm").is_dir() and (_checkout / "pyproject.toml").is_file() \
        and (_checkout / "vmm" / "__init__.py").is_file() and str(_checkout) not in __path__:
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
