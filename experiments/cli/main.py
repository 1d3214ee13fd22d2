"""The `kvlab` command: generate, bench, simulate, fallbacks, sharing.

Each subcommand lives in its own module with `add_parser(subparsers)` and `run(args) -> int`. Any KvlabError,
and any bad flag value, becomes one line on stderr and exit code 2.
"""
from __future__ import annotations

if __name__ == "__main__":  # python -m kvlab.experiments.cli.main: a Ctrl-C during the imports below is one line
    from kvlab.experiments.cli.startup import guard_startup
    guard_startup()

import argparse
import contextlib
import dataclasses
import importlib
import logging
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from kvlab.common.config import EngineConfig, make_config
from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.kv.registry import REGISTRY, backend_names
from kvlab.common.limits import check_physical_budget

# subcommand -> the module with its add_parser(subparsers) and run(args)
SUBCOMMANDS = {"generate": "kvlab.experiments.cli.generate", "bench": "kvlab.experiments.bench.offline",
               "simulate": "kvlab.experiments.sim.cli", "fallbacks": "kvlab.experiments.studies.fallbacks",
               "pool": "kvlab.experiments.pool.cli",
               "sharing": "kvlab.experiments.studies.sharing", "serve": "kvlab.experiments.serve",
               "prefix": "kvlab.experiments.studies.prefix", "calibrate": "kvlab.experiments.bench.calibrate"}
# CLI flag -> EngineConfig field; each is optional and, when given, overrides the TOML file. Backends' own
# options (block_size, page_size, ...) get their flags from their options dataclasses (see backend_flags).
GENERIC_FLAGS = ("model", "backend", "kv_cache_bytes", "watermark", "preemption_mode", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "dtype", "device", "kernel", "seed", "threads",
                 "tensor_parallel_size", "kv_cache_dtype", "kv_cache_scale")
SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
              "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}


class KvlabParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_bytes(text: str) -> int:
    """'64MiB', '1.5GB', '65536' -> bytes (KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m and SIZE_UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 65536, 64KiB, 16MiB, 60GB")
    return int(float(m.group(1)) * unit)


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
    return flags


def engine_flag_names() -> tuple[str, ...]:
    return (*GENERIC_FLAGS, *backend_flags())


def add_engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The EngineConfig flags (all default to None = take the TOML file's or the built-in value)."""
    flags: dict[str, dict[str, Any]] = {
        "config": {"metavar": "FILE", "help": "TOML engine config ([engine] table or top level; backend options "
                                              "flat or in [paged]/[vmm]/[reserve] tables)"},
        "model": {"help": "preset (tiny, smollm2-135m), HF directory or .gguf file"},
        "backend": {"help": " | ".join(backend_names())},
        **backend_flags(),
        "kv_cache_bytes": {"type": parse_bytes, "help": "KV budget, e.g. 4MiB"},
        "watermark": {"type": float, "help": "fraction of KV capacity kept free at admission"},
        "preemption_mode": {"help": "recompute | swap"},
        "max_num_seqs": {"type": int}, "max_num_batched_tokens": {"type": int},
        "max_model_len": {"type": int}, "dtype": {}, "device": {},
        "kv_cache_dtype": {"help": "auto | fp8_e4m3 | fp8_e5m2: K/V stored as 1-byte fp8 (twice the tokens of bf16)"},
        "kv_cache_scale": {"type": float, "help": "fp8 KV scale; 0 (default) = per layer from the first prefill"},
        "kernel": {"help": "attention kernel: auto or a registry name"},
        "seed": {"type": int}, "threads": {"type": int, "help": "torch threads (default 1; 0 = torch default)"},
        "tensor_parallel_size": {"type": int, "help": "ranks sharding the model and KV heads (CPU: gloo)"},
    }
    for name, kw in flags.items():
        if name not in skip:
            p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **kw)


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """Defaults < --config FILE < explicit flags < `overrides` (the subcommand's fixed choices)."""
    values = {k: getattr(args, k, None) for k in engine_flag_names()}
    values.update({k: v for k, v in overrides.items() if v is not None})
    config = make_config(getattr(args, "config", None), **values)
    check_physical_budget(config.device, config.kv_cache_bytes, "lower --kv-cache-bytes")
    return config


def missing_subcommand(name: str, reason: str):
    """Registered in place of a subcommand whose module is not available; fails clearly when used."""
    def run(args: argparse.Namespace) -> int:
        raise ConfigError(f"`kvlab {name}` is unavailable: {reason}")
    return run


def register(subparsers: Any, name: str) -> None:
    module_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        logging.getLogger("kvlab").warning("subcommand %s disabled: %s is missing", name, module_name)
        p = subparsers.add_parser(name, help=f"(unavailable: {module_name} is missing)")
        p.set_defaults(run=missing_subcommand(name, f"{module_name} is missing"))
        return
    module.add_parser(subparsers)


def build_parser() -> KvlabParser:
    parser = KvlabParser(prog="kvlab", description="Compare KV-cache memory managers: vmm, paged, reserve.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        register(subparsers, name)
    return parser


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def check_output_path(path: str | None, flag: str, directory: bool = False) -> None:
    """Before a run starts: `path` can be written (a file in an existing writable directory, or a directory
    that exists or can be created), so results are never lost at the end of a long run. Probed by writing,
    since permission bits say little to root or on read-only mounts; the probe leaves nothing behind."""
    if path is None:
        return
    p = Path(path)
    if directory and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    if not directory and p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file path")
    if not directory and not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: No such file or directory ({p.parent} does not exist)")
    target = p if directory else p.parent
    created = [d for d in (target, *target.parents) if not d.exists()]
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    finally:
        for d in created:
            with contextlib.suppress(OSError):
                d.rmdir()


def undecodable_argument(argv: list[str]) -> str | None:
    """The first argument that is not valid UTF-8 (Python keeps such bytes as lone surrogates)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return ascii(arg)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bad = undecodable_argument(argv)
    if bad is not None:
        print(f"kvlab: error: argument {bad} is not valid UTF-8 text", file=sys.stderr)
        return 2
    command = f"kvlab {argv[0]}" if argv and argv[0] in SUBCOMMANDS else "kvlab"
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:                      # -h (0) or a usage error (2, already printed)
            return int(e.code or 0)
        command = f"kvlab {args.command}"
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(name)s: %(levelname)s: %(message)s")
        return int(args.run(args) or 0)
    except (KvlabError, OSError) as e:        # OSError: an unwritable --out/--json path, a missing file
        if isinstance(e.__context__, KeyboardInterrupt):      # releasing after Ctrl-C failed: the interrupt wins
            print(f"{command}: interrupted (and releasing failed: {first_line(e)})", file=sys.stderr)
            return 130
        print(f"{command}: error: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                 # every `with`/`finally` on the way out has released its engine
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from kvlab.experiments.cli.startup import end_startup
    end_startup()
    sys.exit(main())
