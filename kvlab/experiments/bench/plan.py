"""`kvlab bench`'s plan: the settings of one run, checked before the model loads; the engine configs of every
backend (the bench's defaults where neither a flag nor the --config file sets a value), the workload and
its prompts, and the header that describes them."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.common.config import EngineConfig
from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_int
from kvlab.experiments.bench.units import fair_unit_defaults, rank_shape
from kvlab.experiments.cli import flags
from kvlab.experiments.limits import MAX_REQUESTS
from kvlab.experiments.reporting.tables import results_dir, threads_label, workload_changes
from kvlab.experiments.workloads.requests import Request, WorkloadSpec, build_workload, prompt_token_ids, scaled

log = logging.getLogger("kvlab.bench")

DEFAULT_SCALE = 1 / 8            # seed lengths / 8: prompts median 73, outputs mean 47, max length 512
RESERVE_SEQS = 8                 # default KV budget: this many max-length reservations
DEFAULT_MAX_NUM_SEQS = 256       # high enough that KV memory, not the slot count, limits the batch


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What `kvlab bench` was asked for, built once from its flags (bench/offline.py's settings_from)."""
    backends: tuple[str, ...]
    workload: WorkloadSpec           # the --workload kind; the fields below fill in its sizes
    num_requests: int
    scale: float | None              # None: default_scale decides
    max_len: int
    rate: float
    warmup: int
    repeats: int
    out: str | None = None
    plot_x: str = "step"
    progress: bool = True
    engine_flags: dict[str, Any] = field(default_factory=dict)   # engine flags and --config (None: not given)

    def engine_config(self, backend: str, **overrides: Any) -> EngineConfig:
        return flags.engine_config(self.engine_flags, backend=backend, **overrides)


@dataclass(slots=True)
class BenchPlan:
    backends: list[str]
    configs: dict[str, EngineConfig]
    requests: list[Request]
    prompts: list[list[int]]
    warmup: int
    out_dir: Path
    changes: list[str]               # every transformation applied to the workload, printed in the header
    x_axis: str = "step"             # plots: engine step or wall seconds
    built: dict[str, Any] = field(default_factory=dict)   # backend -> its built cache's figures (built_figures)


def check_settings(settings: BenchSettings) -> None:
    from kvlab.common.kv.registry import backend_names
    known = backend_names()
    unknown = [b for b in settings.backends if b not in known]
    if unknown:
        raise ConfigError(f"unknown backend(s) {', '.join(unknown)}; choose from: {', '.join(known)}")
    if settings.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {settings.warmup}")
    if settings.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {settings.repeats}")
    check_int("--warmup", settings.warmup, 0, MAX_REQUESTS)
    check_int("--repeats", settings.repeats, 1, 1000)
    build_workload(workload_spec(settings))     # every length and arrival checked before the model loads
    flags.check_output_path(settings.out, "--out", directory=True)


def workload_spec(settings: BenchSettings) -> WorkloadSpec:
    seed = settings.engine_flags.get("seed")
    return dataclasses.replace(settings.workload, num_requests=settings.num_requests,
                               scale=default_scale(settings.workload, settings.scale), max_len=settings.max_len,
                               rate=settings.rate, seed=seed if seed is not None else 0)


def default_scale(workload: WorkloadSpec, scale: float | None) -> float:
    """--scale when given; else 1/8 for the built-in seed distribution (CPU-sized) and 1 for anything the user
    supplied (a trace, fixed or uniform lengths): user data is never transformed unless asked."""
    if scale is not None:
        return scale
    return DEFAULT_SCALE if workload.kind == "seed" else 1.0


def make_plan(settings: BenchSettings, model: Any) -> BenchPlan:
    spec = workload_spec(settings)
    requests = build_workload(spec)
    longest = max(r.total_len for r in requests)
    probe = settings.engine_config(settings.backends[0])
    shape = model.kv_shape(probe.dtype, probe.device)
    defaults = bench_defaults(settings, probe, shape, max(longest, scaled(spec.max_len, spec.scale)),
                              unit_shape=rank_shape(shape, probe))
    configs = {b: settings.engine_config(b, **defaults, **backend_defaults(settings, b)) for b in settings.backends}
    built = {b: built_figures(c, shape) for b, c in configs.items()}
    prompts = prompt_token_ids(requests, model.config.vocab_size, seed=spec.seed)
    changes = workload_changes(spec, scale_given=settings.scale is not None, default_scale=DEFAULT_SCALE)
    return BenchPlan(list(settings.backends), configs, requests, prompts, settings.warmup, results_dir(settings.out),
                     changes, settings.plot_x, built)


def check_model_lens(configs: dict[str, EngineConfig], model: Any) -> None:
    """Every backend's max_model_len within the model's positions, before any cache is built."""
    from kvlab.common.runner import check_model_len
    for config in configs.values():
        check_model_len(config.max_model_len, model.config.max_position_embeddings)


def built_figures(config: EngineConfig, shape: Any) -> dict[str, Any]:
    """Build one rank's cache in accounting mode (its geometry and budget checks, no memory), as the engine
    will, so a bad budget fails before the header is printed and the header shows what was built."""
    from kvlab.common.kv.seam import create_cache
    tp = config.tensor_parallel_size
    cache = create_cache(config.replace(kv_cache_bytes=config.kv_cache_bytes // tp), rank_shape(shape, config),
                         accounting_only=True)
    try:
        stats = cache.stats()
    finally:
        cache.close()
    capacity = stats.total_units * stats.tokens_per_unit
    return {"unit": stats.unit_name, "units": stats.total_units, "tokens_per_unit": stats.tokens_per_unit,
            "capacity_tokens": capacity, "bytes_per_token_per_rank": cache.shape.bytes_per_token,
            "page_bytes": stats.extra.get("page_size"), "full_length_seqs": capacity // config.max_model_len,
            "kv_cache_dtype": cache.shape.kv_cache_dtype, "ranks": tp}


def backend_defaults(settings: BenchSettings, backend: str) -> dict[str, Any]:
    """A backend to which the growth watermark does not apply (the reserve baseline holds its final length
    from admission) runs without one unless --watermark says otherwise (as in the simulator), instead of
    losing a sequence."""
    from kvlab.common.config import load_toml
    from kvlab.common.kv.registry import get_backend
    config_file = settings.engine_flags.get("config")
    in_file = bool(config_file) and "watermark" in load_toml(config_file)
    given = settings.engine_flags.get("watermark") is not None or in_file
    return {"watermark": 0.0} if not get_backend(backend).watermark and not given else {}


def bench_defaults(settings: BenchSettings, probe: EngineConfig, shape: Any, max_len: int,
                   unit_shape: Any = None) -> dict[str, Any]:
    """Values the bench picks when neither a flag nor the --config file sets them; `unit_shape`, the shape one
    rank's cache is built with (default `shape`), sizes the units."""
    from kvlab.common.config import load_toml
    config_file = settings.engine_flags.get("config")
    toml = load_toml(config_file) if config_file else {}
    given = {*toml, *(k for table in toml.values() if isinstance(table, dict) for k in table)}   # [vmm] page_size
    given |= {k for k in flags.engine_flag_names() if settings.engine_flags.get(k) is not None}
    choices: dict[str, Any] = {
        "max_model_len": max_len,
        "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
        "max_num_batched_tokens": max(2048, max_len, DEFAULT_MAX_NUM_SEQS),
        "kv_cache_bytes": RESERVE_SEQS * max_len * shape.bytes_per_token,
        "threads": 1,                # the config default too; named here so a TOML value still wins
        **fair_unit_defaults(probe, (unit_shape or shape).bytes_per_token_per_layer),
    }
    return {k: v for k, v in choices.items() if k not in given}


def load(config: EngineConfig):
    from kvlab.common.loader import load_model
    t0 = time.perf_counter()
    model, tokenizer = load_model(config.model, config.dtype, config.device, config.seed)
    log.info("loaded %s in %.1f s", config.model, time.perf_counter() - t0)
    return model, tokenizer


def describe(plan: BenchPlan, model: Any) -> str:
    c = plan.configs[plan.backends[0]]
    p = [r.prompt_len for r in plan.requests]
    o = [r.output_len for r in plan.requests]
    watermarks = ", ".join(f"{b} {plan.configs[b].watermark:g}" for b in plan.backends)
    lines = [
        (f"kvlab bench: model {c.model} ({c.dtype}, {c.device}, {threads_label(c.threads)}), backends "
         f"{', '.join(plan.backends)}"),
        (f"workload: {len(plan.requests)} requests, prompts {min(p)}-{max(p)} (mean {sum(p) / len(p):.0f}), "
         f"outputs {min(o)}-{max(o)} (mean {sum(o) / len(o):.0f}), greedy, ignore_eos"),
        f"workload changes: {'; '.join(plan.changes) or 'none'}",
        (f"KV budget {c.kv_cache_bytes / 2**20:.1f} MiB{budget_split(c)}, KV dtype {c.kv_cache_dtype}; "
         f"watermark {watermarks}; preemption {c.preemption_mode}; as built:"),
        *(f"  {built_line(b, plan.built[b], plan.configs[b].max_model_len)}" for b in plan.backends),
    ]
    return "\n".join(lines)


def budget_split(config: EngineConfig) -> str:
    tp = config.tensor_parallel_size
    return "" if tp == 1 else f" ({config.kv_cache_bytes // tp / 2**20:.1f} MiB on each of {tp} ranks)"


def built_line(backend: str, built: dict[str, Any], max_model_len: int) -> str:
    """One backend's built cache: capacity, its unit, and how many full-length sequences it holds."""
    per_rank = " per rank" if built["ranks"] > 1 else ""
    units = ""
    if built["tokens_per_unit"] > 1:
        page = f", {built['page_bytes'] // 1024} KiB pages" if built.get("page_bytes") else ""
        units = f" = {built['units']:,} {built['unit']}s x {built['tokens_per_unit']} tokens{page}"
    return (f"{backend}: {built['capacity_tokens']:,} tokens{per_rank} ({built['bytes_per_token_per_rank']:,} "
            f"B/token{per_rank}){units}; holds {built['full_length_seqs']} x {max_model_len}-token sequences")
