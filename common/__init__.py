"""kvlab common: config, model, scheduler, runner, sampler, kernel registry, metrics and the LLM API."""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:  # lazy: `import common` stays light for the CLI and tests
    if name == "LLM":
        from common.llm import LLM
        return LLM
    if name == "SamplingParams":
        from common.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from common.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'common' has no attribute {name!r}")
