"""kvlab: compare KV-cache memory managers (vAttention-style VMM, PagedAttention, reservation) under one
scheduler and one model runner.

    from kvlab import LLM, SamplingParams, EngineConfig

The subpackages `kvlab.common`, `kvlab.vmm`, `kvlab.paged`, `kvlab.reserve` and `kvlab.experiments` live in this
folder, so the one import name resolves by path for the interpreter and for tools alike; the repository's top-level
common/, vmm/, paged/, reserve/ and experiments/ are links to them, kept for the design's folder names.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "EngineConfig", "SamplingParams"]


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
