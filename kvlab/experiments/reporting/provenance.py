"""Where a results file came from, recorded in every one: the resolved configuration, kvlab's version and commit,
torch's version and the machine. A results directory holds it as provenance.json; a JSON results file also
carries it under "provenance", so a file copied out of its directory still says where it came from."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FILE = "provenance.json"


def provenance(config: dict[str, Any]) -> dict[str, Any]:
    """`config`: the run's resolved configuration as plain JSON values (what `kvlab compare` diffs first)."""
    return {"config": jsonable(config), "kvlab": {"version": kvlab_version(), "commit": source_revision()},
            "torch": torch_version(), "machine": machine_info(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def torch_version() -> str:
    """The loaded torch's version; for a run that never loaded torch (the simulators), the installed one's,
    read without the second of importing it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def write_provenance(out: Path, record: dict[str, Any]) -> None:
    """provenance.json in a results directory."""
    out.mkdir(parents=True, exist_ok=True)
    (out / FILE).write_text(json.dumps(record, indent=1))


def read_provenance(path: Path) -> dict[str, Any] | None:
    """A results directory's provenance.json, or a JSON results file's "provenance"; None when neither has one."""
    path = Path(path)
    target = path / FILE if path.is_dir() else path
    if not target.is_file() or target.suffix != ".json":
        return None
    try:
        doc = json.loads(target.read_text())
    except (OSError, ValueError):
        return None
    return doc if path.is_dir() else doc.get("provenance") if isinstance(doc, dict) else None


def engine_config(config: Any) -> dict[str, Any]:
    """An EngineConfig as the run used it: the generic keys and its own backend's options (not the defaults of
    every other backend registered)."""
    generic = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "options"}
    return {**generic, config.backend: dataclasses.asdict(config.backend_options)}


def served_config(argv: list[str]) -> dict[str, Any]:
    """The engine config a `kvlab serve` started with `argv` (its flags after `serve`) runs, resolved as the
    server resolves it."""
    import argparse

    from kvlab.experiments.cli import flags
    from kvlab.experiments.serve.cli import add_parser
    parser = flags.KvlabParser(prog="kvlab")
    add_parser(parser.add_subparsers(dest="command"))
    return engine_config(flags.engine_config(vars(parser.parse_args(["serve", *argv], argparse.Namespace()))))


PLAIN = frozenset({float, int, str, bool, type(None)})


def jsonable(value: Any) -> Any:
    """Plain JSON values: dataclasses as dicts, tuples and sets as lists, paths and anything else as text."""
    if type(value) in PLAIN:          # most of a results file: returned before the slower tests below
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def rows_json(doc: dict[str, Any], rows_key: str) -> str:
    """`doc` as JSON text, indented, but with each element of `doc[rows_key]` on one compact line. A simulated
    search's per-request rows are megabytes, and Python's json encodes in C only without an indent (5x faster)."""
    head = json.dumps({k: v for k, v in doc.items() if k != rows_key}, indent=1)
    body = ",\n".join(json.dumps(r) for r in doc[rows_key])
    tail = f'"{rows_key}": [\n{body}\n ]\n}}'
    return f"{{\n {tail}" if head == "{}" else f"{head[:-2]},\n {tail}"


def kvlab_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvlab")
    except PackageNotFoundError:
        return "unknown (not installed)"


def machine_info() -> dict[str, Any]:
    """The machine, and what torch sees of it when the run loaded torch (None where it did not: a simulator's
    record names no GPU and no thread count because it used neither)."""
    torch = sys.modules.get("torch")
    gpu = torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "platform": platform.platform(), "torch_threads": torch.get_num_threads() if torch is not None else None,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def source_revision() -> str | None:
    """The commit of the checkout kvlab runs from, marked "+dirty" when tracked files differ from it; None when
    kvlab is not run from a git checkout (read-only git calls)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git(here, "ls-files", "--error-unmatch", os.path.basename(__file__))   # this file is tracked, not a copy
        commit = git(here, "rev-parse", "--short", "HEAD")
        dirty = git(here, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def git(cwd: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
