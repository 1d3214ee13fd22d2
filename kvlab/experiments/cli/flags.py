"""The flag library every `kvlab` command shares: value parsers (sizes, lists, booleans), the engine flags
generated from EngineConfig and the backends' options dataclasses, the one place an EngineConfig is built from
flag values, and the output-path probe run before a long run starts."""
from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvlab.common.config import EngineConfig, make_config
from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.kv.registry import REGISTRY, backend_names
from kvlab.common.machine import check_physical_budget
from kvlab.common.validate import check_text, probe_writable, shown
from kvlab.experiments.cli.parser import KvlabParser, first_line  # noqa: F401 (re-exported for the commands)

# CLI flag -> EngineConfig field; each is optional and, when given, overrides the TOML file. Backends' own
# options (block_size, page_size, ...) get their flags from their options dataclasses (see backend_flags).
GENERIC_FLAGS = ("model", "backend", "kv_cache_bytes", "watermark", "preemption_mode", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "dtype", "device", "kernel", "seed", "threads",
                 "tensor_parallel_size", "kv_cache_dtype", "kv_cache_scale", "handoff_timeout_s", "kv_pool",
                 "kv_pool_bytes", "handoff_name", "handoff_peers")
SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
              "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}


MAX_SIZE_BYTES = 2**60        # any size flag: far beyond any machine's memory, and an int everywhere below


def parse_bytes(text: str) -> int:
    """'64MiB', '1.5GB', '65536' -> bytes (KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m and SIZE_UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise argparse.ArgumentTypeError(f"bad size {shown(text)}; use e.g. 65536, 64KiB, 16MiB, 60GB")
    size = float(m.group(1)) * unit                  # inf for 400 digits
    if not size <= MAX_SIZE_BYTES:
        raise argparse.ArgumentTypeError(f"size {shown(text)} is more than {MAX_SIZE_BYTES:,} bytes (1 EiB)")
    return int(size)


def parse_device(text: str) -> str:
    """'cpu', 'cuda' or 'cuda:N'."""
    from kvlab.common.config import DEVICE
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"unknown device {shown(text)}; use cpu or cuda[:N]")
    return text


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type=` that keeps a KvlabError's actionable message (argparse would print only
    "invalid <name> value" for a ValueError)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except KvlabError as e:
            raise argparse.ArgumentTypeError(first_line(e)) from None
    convert.__name__ = parse.__name__
    return convert


def parse_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"empty list {text!r}")
    return items


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def backend_flags() -> dict[str, dict[str, Any]]:
    """One flag per field of every registered backend's options dataclass."""
    parsers = {"int": int, "float": float, "bool": parse_bool, "str": str}
    flags = {}
    for spec in REGISTRY.specs():
        for f in dataclasses.fields(spec.options):
            parse = parse_bytes if f.metadata.get("bytes") else parsers.get(str(f.type), str)
            flags[f.name] = {"type": parse, "help": f.metadata.get("help", f"{spec.name} option")}
            if "metavar" in f.metadata:
                flags[f.name]["metavar"] = f.metadata["metavar"]
    return flags


def engine_flag_names() -> tuple[str, ...]:
    return (*GENERIC_FLAGS, *backend_flags())


def add_engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The EngineConfig flags (all default to None = take the TOML file's or the built-in value)."""
    tables = ", ".join(f"[{name}]" for name in backend_names())
    flags: dict[str, dict[str, Any]] = {
        "config": {"metavar": "FILE", "help": "TOML engine config ([engine] table or top level; backend options "
                                              f"flat or in a table per backend: {tables})"},
        "model": {"help": "preset (tiny, smollm2-135m), HF directory or .gguf file"},
        "backend": {"help": " | ".join(backend_names())},
        **backend_flags(),
        "kv_pool": {"metavar": "NAME",
                    "help": "draw KV pages from this machine-wide pool (vmm, elastic; docs/pool.md)"},
        "kv_pool_bytes": {"type": parse_bytes, "metavar": "BYTES",
                          "help": "create the --kv-pool with this budget if no engine serves it yet, e.g. 8GiB"},
        "kv_cache_bytes": {"type": parse_bytes, "help": "KV budget, e.g. 4MiB"},
        "watermark": {"type": float, "help": "fraction of KV capacity kept free at admission"},
        "preemption_mode": {"help": "recompute | swap"},
        "max_num_seqs": {"type": int}, "max_num_batched_tokens": {"type": int},
        "max_model_len": {"type": int}, "dtype": {}, "device": {},
        "kv_cache_dtype": {"help": "auto | fp8_e4m3 | fp8_e5m2: K/V stored as 1-byte fp8 (twice the tokens of bf16)"},
        "kv_cache_scale": {"type": float, "help": "fp8 KV scale; 0 (default) = per layer from the first prefill"},
        "kernel": {"help": "attention kernel: auto or a registry name"},
        "linear": {"help": "the Linear layers' GEMM: auto (oneDNN for float32 on the CPU), onednn or torch"},
        "seed": {"type": int}, "threads": {"type": int, "help": "torch threads (default 1; 0 = torch default)"},
        "tensor_parallel_size": {"type": int, "help": "ranks sharding the model and KV heads (CPU: gloo)"},
        "handoff_timeout_s": {"type": float, "metavar": "S",
                              "help": "kv_role prefill: seconds kept KV waits for a decode engine's pull (default 30)"},
        "handoff_name": {"metavar": "NAME",
                         "help": "kv_role prefill: serve pulls at this fixed name (default: a random one), so decode "
                                 "engines can list it in --handoff-peers"},
        "handoff_peers": {"type": parse_list, "metavar": "NAME,...",
                          "help": "kv_role decode: pull only from prefill engines serving at these names "
                                  "(default: any engine of this user; docs/security.md)"},
    }
    for name, kw in flags.items():
        if name not in skip:
            p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **kw)


def engine_config(flag_values: Mapping[str, Any], **overrides: Any) -> EngineConfig:
    """Defaults < --config FILE < explicit flags (`flag_values`, e.g. vars(args)) < `overrides` (the
    subcommand's fixed choices)."""
    values = {k: flag_values.get(k) for k in engine_flag_names()}
    values.update({k: v for k, v in overrides.items() if v is not None})
    config = make_config(flag_values.get("config"), **values)
    check_physical_budget(config.device, config.kv_cache_bytes, "lower --kv-cache-bytes")
    return config


def check_output_path(path: str | None, flag: str, directory: bool = False) -> None:
    """Before a run starts: `path` can be written (a file in an existing writable directory, or a directory
    that exists or can be created), so results are never lost at the end of a long run. Probed by writing,
    since permission bits say little to root or on read-only mounts; the probe leaves nothing behind."""
    if path is None:
        return
    p = Path(check_text(flag, path, 4096))          # a NUL byte or lone surrogate: one line, before any OS call
    if directory and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    if not directory and p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file path")
    if not directory and not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: No such file or directory ({p.parent} does not exist)")
    probe_writable(p if directory else p.parent, f"{flag} {path}")


def add_fleet_workload_flags(p: argparse.ArgumentParser) -> None:
    """The arrivals, dataset, model and hardware of a simulated fleet of engines (simulate pool, pd)."""
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--dataset", choices=("seed", "random"), default="seed")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--input-len", type=int, default=1024, help="random dataset")
    p.add_argument("--output-len", type=int, default=128, help="random dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--watermark", type=float, default=0.05)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--mfu", type=float, default=0.5)


def add_search_run_flags(p: argparse.ArgumentParser) -> None:
    """The SLO search's start and tolerance and a simulation run's workers and output (simulate pool, pd)."""
    p.add_argument("--slo-start", type=float, default=4.0, help="first rate the search tries")
    p.add_argument("--slo-tolerance", type=float, default=0.02, help="relative width at which bisection stops")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>/); every finished "
                                                "point is kept there as it finishes (points.jsonl)")
    p.add_argument("--resume", metavar="DIR", help="finish the interrupted run in DIR: its command line again, "
                                                   "only the points it does not hold yet")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--no-progress", action="store_true")
