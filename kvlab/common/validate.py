"""The one validation layer for what a user gives (CLI, TOML, API, server, trace files): each check returns the
value in its proper type or raises a one-line KvlabError that names the value, the rule and what was given.
The bounds themselves, and the checks against one named bound (check_seed), live in common/limits.py."""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError, KvlabError

SHOWN_CHARS = 40                   # a value is quoted in a message up to this many characters


def shown(value: Any) -> str:
    """repr(value), cut: a message stays one short line whatever was given (repr escapes newlines, NUL and lone
    surrogates, so the line also prints on any terminal)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def is_digits(text: str) -> bool:
    """ASCII digits only: `str.isdigit` also passes characters such as '²' and '①', which `int` refuses."""
    return text.isascii() and text.isdigit()


def as_int(value: Any) -> int | None:
    """An int, or a float without a fraction (JSON writes 1e3 as a float); None for anything else. A bool is not
    an int, and neither is a float beyond 2**53, where floats no longer hold every integer."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    return None


def as_finite(value: Any) -> float | None:
    """A finite int or float (not a bool, not a string); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:          # an int beyond the float range
        return None
    return number if math.isfinite(number) else None


def check_int(name: str, value: Any, low: int, high: int, why: str = "",
              error: type[KvlabError] = ConfigError) -> int:
    """`value` as an int in [low, high]; `why` names the bound, e.g. " (tokens per sequence)"."""
    number = as_int(value)
    if number is None or not low <= number <= high:
        raise error(f"{name} must be an integer in [{low:,}, {high:,}]{why}, got {shown(value)}")
    return number


def parse_int(name: str, text: str, low: int, high: int, why: str = "",
              error: type[KvlabError] = ConfigError) -> int:
    """An integer written as text (a spec's suffix such as `mooncake:FILE:BLOCK`), in [low, high]."""
    try:
        value: Any = int(text, 10)
    except ValueError:             # not digits, or more digits than Python converts
        value = text
    return check_int(name, value, low, high, why, error)


def check_number(name: str, value: Any, low: float = 0.0, high: float = math.inf, strict: bool = False,
                 unit: str = "", error: type[KvlabError] = ConfigError) -> float:
    """`value` as a finite float, >= low (> low when strict) and <= high; `unit` follows the bounds, e.g. " s"."""
    number = as_finite(value)
    if number is None or not (number > low if strict else number >= low) or number > high:
        raise error(f"{name} must be a finite number {_bounds(low, high, strict)}{unit}, got {shown(value)}")
    return number


def _bounds(low: float, high: float, strict: bool) -> str:
    if not strict and high < math.inf:
        return f"in [{low:.15g}, {high:.15g}]"
    return f"{'>' if strict else '>='} {low:.15g}" + (f" and <= {high:.15g}" if high < math.inf else "")


def check_group(name: str, values: dict[str, Any], low: int, high: int,
                error: type[KvlabError] = ConfigError) -> list[int]:
    """Integers that share one range (a request's lengths), reported together so one message shows them all."""
    numbers = [as_int(v) for v in values.values()]
    if any(n is None or not low <= n <= high for n in numbers):
        given = ", ".join(f"{key} {shown(v)}" for key, v in values.items())
        raise error(f"{name} must be in [{low:,}, {high:,}], got {given}")
    return numbers


def check_text(name: str, value: Any, max_chars: int, error: type[KvlabError] = ConfigError) -> str:
    """A str of at most max_chars that can be written as UTF-8 and passed to C: no NUL, no lone surrogate
    (what Python keeps of undecodable bytes)."""
    if not isinstance(value, str):
        raise error(f"{name} must be a string, got {shown(value)}")
    if len(value) > max_chars:
        raise error(f"{name} must be at most {max_chars:,} characters, got {len(value):,}")
    if "\0" in value:
        raise error(f"{name} must not contain a NUL character, got {shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{name} is not valid UTF-8 text: {shown(value)}") from None
    return value


def user_path(name: str | Path) -> Path:
    """`name` with a leading ~ or ~user expanded; left as it is when that user does not exist (pathlib raises)."""
    return Path(os.path.expanduser(str(name)))


def check_output_path(name: str, path: str | Path, directory: bool = False) -> Path:
    """Before any work or output: `path` can be written (a file in an existing directory, or a directory that
    exists or can be made). Probed by writing, as permission bits say little to root or on a read-only mount;
    the probe leaves nothing behind, not even the directories it made."""
    p = Path(check_text(name, str(path), 4096))
    if directory and p.exists() and not p.is_dir():
        raise ConfigError(f"{name} {shown(str(p))}: exists and is not a directory")
    if not directory and p.is_dir():
        raise ConfigError(f"{name} {shown(str(p))}: is a directory; give a file path")
    if not directory and not p.parent.is_dir():
        raise ConfigError(f"{name} {shown(str(p))}: its directory {shown(str(p.parent))} does not exist")
    folder = p if directory else p.parent
    probe_writable(folder, f"{name} {shown(str(folder))}")
    return p


def probe_writable(folder: Path, what: str) -> None:
    """Write (and remove) a temporary file in `folder`, making it for the probe if needed and removing what was
    made; a failure is one ConfigError line starting with `what`."""
    created = [d for d in (folder, *folder.parents) if not d.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: cannot write there ({e.strerror or e})") from None
    finally:
        for d in created:
            with contextlib.suppress(OSError):
                d.rmdir()
