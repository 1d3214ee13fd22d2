"""Fair units: the bench's default unit of every backend holds as many tokens as a paged block, counted in the
bytes one rank's cache is built with (the KV dtype and the tensor-parallel share of the heads included), so an
A/B compares memory managers, not granularity. Used by `kvlab bench` and `kvlab sharing`."""
from __future__ import annotations

import dataclasses
from typing import Any


def rank_shape(shape: Any, config: Any) -> Any:
    """The KV shape one rank's cache is built with: the config's KV dtype, this rank's share of the heads."""
    tp = config.tensor_parallel_size
    return dataclasses.replace(shape, kv_cache_dtype=config.kv_cache_dtype, num_kv_heads=shape.num_kv_heads // tp,
                               num_q_heads=shape.num_q_heads // tp)


def fair_unit_defaults(config: Any, token_bytes: int) -> dict[str, int]:
    """Unit option -> value holding as many tokens as a block (given or default) for every registered backend
    with a unit option; `token_bytes`: one token of one layer's K as built (rank_shape's)."""
    from kvlab.common.kv.registry import REGISTRY, fair_units
    specs = [s for s in REGISTRY.specs() if s.unit_field() is not None]
    by_tokens = next(s for s in specs if not s.unit_field().metadata.get("bytes"))
    return fair_units(specs, getattr(config.options_of(by_tokens.name), by_tokens.unit_field().name), token_bytes)
