"""Warnings for KV-cache settings that run but cap the batch or waste most of the cache.

One function for every entry point (generate, the LLM API, bench): it reads the built cache's stats() and the
config, and returns one line per problem, each with the setting to change. Nothing is changed or refused here.
The setting that sizes a unit comes from the backend's registered spec (`unit_field`), never from its name.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvlab.capacity")

FEW_SEQUENCES = 4          # a cache that runs fewer sequences at once than this (and than max_num_seqs) is a trap
MOST = 0.5                 # "wastes most of the cache": more than this fraction of every unit can never be used
BYTE_STEP = 4096           # a unit size given in bytes is advised in whole 4 KiB host pages


def capacity_warnings(config: Any, stats: Any, holds_final_length: bool = False) -> list[str]:
    """config: EngineConfig; stats: CacheStats of the built cache; holds_final_length: the backend reserves a
    request's whole length at admission instead of growing unit by unit (its spec takes no watermark)."""
    unit, tpu, units = stats.unit_name, max(1, stats.tokens_per_unit), stats.total_units
    max_len, wanted = config.max_model_len, min(config.max_num_seqs, FEW_SEQUENCES)
    capacity = units * tpu
    flag = config.spec.unit_flag() or f"the {unit} size"
    out = []
    if capacity < max_len:
        need = -(-max_len * config.kv_cache_bytes // max(1, capacity))
        out.append(f"the KV budget holds {capacity:,} tokens, less than max_model_len {max_len:,}: a request that "
                   f"long can never run; raise --kv-cache-bytes to at least {need:,} or lower --max-model-len")
    per_seq = -(-max_len // tpu) if holds_final_length else 1
    runs_at_once = units // per_seq
    if runs_at_once < wanted:
        what = f"{units:,} {unit}{'s' if units != 1 else ''} of {tpu:,} tokens" if tpu > 1 else f"{capacity:,} tokens"
        fix = (f"use a smaller {flag} or a larger --kv-cache-bytes" if tpu > 1 and not holds_final_length
               else "raise --kv-cache-bytes or lower --max-model-len")
        out.append(f"the KV cache holds {what}: at most {runs_at_once} sequence(s) run at once "
                   f"(max_num_seqs {config.max_num_seqs}); {fix}")
    if tpu > 1 and 1 - max_len / tpu > MOST:
        out.append(f"each {unit} holds {tpu:,} tokens but a sequence holds at most {max_len:,} (max_model_len): at "
                   f"least {1 - max_len / tpu:.0%} of every {unit} stays empty; use a {flag} of at most "
                   f"{largest_unit(config, tpu, max_len)}")
    return out


def largest_unit(config: Any, tpu: int, max_len: int) -> str:
    """The biggest unit that still fits a max-length sequence, in the unit option's own terms (bytes or tokens)."""
    spec = config.spec
    field = spec.unit_field()
    if field is None or not field.metadata.get("bytes"):
        return f"{max_len:,} tokens"
    size = getattr(config.options_of(spec.name), field.name)
    return f"{max(BYTE_STEP, size * max_len // tpu // BYTE_STEP * BYTE_STEP):,} bytes"


def warn_capacity(config: Any, cache: Any) -> list[str]:
    """Log every capacity warning for a built KVCache (one line each); returns them."""
    lines = capacity_warnings(config, cache.stats(), holds_final_length=not config.spec.watermark)
    for line in lines:
        log.warning("%s: %s", config.backend, line)
    return lines
