"""Typed option fields shared by EngineConfig and the backends' option dataclasses: every value is checked
against its declared type (a TOML string "false" is not a boolean), with one-line errors."""
from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.common.errors import ConfigError

_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def check_types(obj: Any, where: str = "") -> None:
    """Raise ConfigError for the first field whose value does not have its annotated type (int, float,
    bool, str, or one of them `| None`; a bool is never accepted as a number)."""
    for f in dataclasses.fields(obj):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        value = getattr(obj, f.name)
        if kind.endswith(" | None"):              # an optional field: None, or a value of its type
            if value is None:
                continue
            kind = kind.removesuffix(" | None")
        if kind not in _TYPES:
            continue
        ok = isinstance(value, _TYPES[kind]) and not (kind in ("int", "float") and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{where}{f.name} must be {_NAMES[kind]}, got {value!r}")


def check_positive(obj: Any, *names: str, where: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}{name} must be a positive integer, got {value!r}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")
